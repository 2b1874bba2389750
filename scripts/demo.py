"""`make demo`: serve the default checkpoint and talk to it in real time, as a microphone would.

Starts `tritonserver` on this repository's model repository (free ports), streams
samples/user.wav through the `ensemble` model with the gRPC client, one 80 ms frame every
80 ms, showing frames, latency and the agent's text as they come; then writes the agent's
audio and text under out/, prints the figures of the paced stream, and stops the server.
The voice's persona was prefilled when the model loaded, so the conversation starts at once.
"""

import argparse
import json
import sys
from pathlib import Path

from personaplex_stream import LiveLine, Persona, contract, stream_conversation
from personaplex_stream.audio import read_wav, write_wav
from personaplex_triton.core.metrics import stage_setups
from personaplex_triton.core.paths import REPO_ROOT
from personaplex_triton.serving.launch import TritonServer

FRAME_MS = round(1000 * contract.FRAME_SAMPLES / contract.SAMPLE_RATE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, default=REPO_ROOT / "samples" / "user.wav")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "out")
    parser.add_argument("--voice", default="NATF0")
    parser.add_argument("--prompt", default="", help="a role prompt; the personas prefilled at load have none, "
                                                     "so a prompt's prefill comes before the first answer")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    user = read_wav(args.input)
    log_path = args.out / "tritonserver.log"
    print(f"starting tritonserver (log: {log_path}) ...", flush=True)
    with TritonServer(log_path=log_path) as server:
        warmed = stage_setups(server.metrics_url, expect=("talker",))["talker"].warm_personas
        print(f"ready in {server.ready_s:.1f} s on {server.grpc_url}; "
              f"personas prefilled at load: {', '.join(warmed) or 'none'}")
        starts_at_once = args.voice in warmed and not args.prompt.strip()
        print(f"streaming {args.input.name} ({user.size / contract.SAMPLE_RATE:.1f} s) in real time, one {FRAME_MS} ms frame "
              f"every {FRAME_MS} ms; voice {args.voice}"
              + ("" if starts_at_once else ": its persona's prefill comes first"), flush=True)
        live = LiveLine(sys.stdout)
        result = stream_conversation(user, url=server.grpc_url, realtime=True, on_frame=live,
                                     persona=Persona(voice=args.voice, text_prompt=args.prompt or None,
                                                     seed=args.seed))
        live.end()

    wav_path, text_path, summary_path = args.out / "agent.wav", args.out / "agent.txt", args.out / "summary.json"
    write_wav(wav_path, result.audio)
    text_path.write_text(result.text + "\n")
    summary = {**result.summary(), "time_to_ready_s": round(server.ready_s, 2), "prefilled_at_load": warmed,
               "persona_prefilled_at_load": starts_at_once}
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"agent audio {wav_path} ({result.audio_seconds:.1f} s), text {text_path}, figures {summary_path}")
    print(f"{result.frames_received}/{result.frames_sent} frames answered")
    print(f"real-time factor {result.real_time_factor:.2f}: {result.wall_s:.1f} s to answer "
          f"{result.audio_seconds:.1f} s of speech sent in real time (1.00: the server kept pace)")
    print(f"first audio {result.first_audio_ms:.0f} ms after the first frame was sent")
    print(f"frame latency, sent to answered: p50 {result.latency_ms_p50:.0f} ms, p95 {result.latency_ms_p95:.0f} ms "
          f"(a frame is {FRAME_MS} ms of speech)")
    return 0 if result.frames_received == result.frames_sent else 1


if __name__ == "__main__":
    sys.exit(main())
