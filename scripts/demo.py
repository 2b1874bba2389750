"""`make demo`: serve the default checkpoint, stream a sample conversation, save the answer.

Starts `tritonserver` on this repository's model repository (free ports), streams
samples/user.wav through the `ensemble` model with the gRPC client, writes the agent's audio
and text under out/, prints the latency figures, and stops the server.
"""

import argparse
import json
import sys
import time
from pathlib import Path

from personaplex_stream import Persona, stream_conversation
from personaplex_triton import audio
from personaplex_triton.launch import REPO_ROOT, TritonServer

PROMPT = ("You are a wise and friendly teacher. "
          "Answer questions or provide advice in a clear and engaging way.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, default=REPO_ROOT / "samples" / "user.wav")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "out")
    parser.add_argument("--voice", default="NATF0")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    user = audio.read_wav(args.input)
    log_path = args.out / "tritonserver.log"
    print(f"starting tritonserver (log: {log_path}) ...", flush=True)
    with TritonServer(log_path=log_path) as server:
        print(f"ready in {server.ready_s:.1f} s on {server.grpc_url}", flush=True)
        started = time.monotonic()
        result = stream_conversation(
            user, url=server.grpc_url,
            persona=Persona(voice=args.voice, text_prompt=args.prompt, seed=args.seed))
        wall_s = time.monotonic() - started

    wav_path, text_path, summary_path = args.out / "agent.wav", args.out / "agent.txt", args.out / "summary.json"
    audio.write_wav(wav_path, result.audio)
    text_path.write_text(result.text + "\n")
    summary = {**result.summary(), "time_to_ready_s": round(server.ready_s, 2),
               "conversation_wall_s": round(wall_s, 2)}
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"agent audio: {wav_path} ({result.audio_seconds:.1f} s)")
    print(f"agent text:  {text_path}")
    print(f"summary:     {summary_path}")
    print(f"time to ready {server.ready_s:.1f} s; {result.frames_received}/{result.frames_sent} frames; "
          f"first audio {result.first_audio_ms:.0f} ms; per-frame latency p50 {result.latency_ms_p50:.0f} ms, "
          f"p95 {result.latency_ms_p95:.0f} ms")
    return 0 if result.frames_received == result.frames_sent else 1


if __name__ == "__main__":
    sys.exit(main())
