"""Latency of the served pipeline on this machine: time to ready, prefill, per-frame round trip.

Starts `tritonserver` on the model repository (the checkpoint named by
$PERSONAPLEX_CHECKPOINT, else checkpoints/tiny), then streams samples/user.wav through
`ensemble` with the gRPC client:
  - one conversation, one frame in flight: the per-frame round trip (Mimi encode, LM step,
    depformer, Mimi decode, Triton), frame after frame;
  - N conversations at once, one frame in flight each: the same when N share each tick;
  - one conversation, 8 frames in flight: throughput in frames per second;
  - one conversation whose persona was seen before: first audio without the prefill.
Writes bench/results/{cpu,gpu}_latency.{json,md,png} (gpu_ where CUDA is present). Medians of
one run; machines are noisy.

    make bench-serve        (or: .venv/bin/python bench/serve_latency.py --conversations 1 2 4)
"""

import argparse
import json
import platform
import threading
import time
from datetime import date
from pathlib import Path

import numpy as np

from personaplex_stream import Persona, stream_conversation
from personaplex_triton import audio
from personaplex_triton.launch import REPO_ROOT, TritonServer

RESULTS = REPO_ROOT / "bench" / "results"


NAMES = ("Anna", "Boris", "Clara", "David", "Emma", "Felix", "Grace", "Henry")
TOPICS = ("travel", "banking", "cooking", "gardening", "music", "sports")


def concurrent(url, pcm, n, max_in_flight, topic):
    """n conversations at once, each with its own role prompt (a new persona, which pays its
    prefill unless the server saw that prompt before)."""
    results = [None] * n

    def talk(i):
        persona = Persona(voice="NATF0", text_prompt=f"You are {NAMES[i]}. You help with {topic}.", seed=i)
        results[i] = stream_conversation(pcm, url=url, max_in_flight=max_in_flight, persona=persona)

    threads = [threading.Thread(target=talk, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def row(name, results):
    lat = np.concatenate([r.latencies_ms[1:] for r in results])  # frame 0 waits for the prefill
    frames = sum(r.frames_received for r in results)
    wall = max(r.wall_s for r in results)
    first = np.median([r.first_audio_ms for r in results])
    return {"run": name, "conversations": len(results), "frames": frames,
            "first_audio_ms_median": round(float(first), 1),
            "frame_ms_p50": round(float(np.percentile(lat, 50)), 1),
            "frame_ms_p95": round(float(np.percentile(lat, 95)), 1),
            "frames_per_s": round(frames / wall, 2)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seconds", type=float, default=4.0, help="user audio per conversation")
    args = parser.parse_args()
    pcm = audio.read_wav(REPO_ROOT / "samples" / "user.wav")[: int(args.seconds * 24000)]

    launched = time.monotonic()
    with TritonServer(log_path=RESULTS / "tritonserver.log") as server:
        ready_s = server.ready_s
        url = server.grpc_url
        rows = [row(f"{n} conversation(s), 1 frame in flight each", concurrent(url, pcm, n, 1, topic))
                for n, topic in zip(args.conversations, TOPICS)]
        rows.append(row("1 conversation, 8 frames in flight", concurrent(url, pcm, 1, 8, TOPICS[-1])))
        rows.append(row("1 conversation, a persona seen before (cached prefill)",
                        concurrent(url, pcm, 1, 1, TOPICS[0])))
    report = {"date": date.today().isoformat(), "machine": _machine(),
              "python": platform.python_version(), "time_to_ready_s": round(ready_s, 2),
              "bench_wall_s": round(time.monotonic() - launched, 1), "audio_s_per_conversation": args.seconds,
              "rows": rows}
    name = "gpu_latency" if _gpu() else "cpu_latency"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(report))
    plot(report, RESULTS / f"{name}.png")
    print(markdown(report))


def _gpu() -> str | None:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def _machine() -> str:
    import os
    gpu = _gpu()
    return f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs, {gpu or 'no GPU'}"


def markdown(report):
    lines = [f"# Served latency ({report['date']}, {report['machine']}, Python {report['python']})", "",
             f"Time to ready: {report['time_to_ready_s']} s. User audio: {report['audio_s_per_conversation']} s "
             "per conversation. Frame latency = send to receive of one frame (frame 0, which waits "
             "for the persona prefill, left out). Command: `make bench-serve`.", "",
             "| run | frames | first audio (ms, median) | frame p50 (ms) | frame p95 (ms) | frames/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["rows"]:
        lines.append(f"| {r['run']} | {r['frames']} | {r['first_audio_ms_median']} | {r['frame_ms_p50']} | "
                     f"{r['frame_ms_p95']} | {r['frames_per_s']} |")
    return "\n".join(lines) + "\n"


def plot(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if "in flight each" in r["run"]]
    n = [r["conversations"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(n, [r["frame_ms_p50"] for r in rows], "o-", label="p50")
    left.plot(n, [r["frame_ms_p95"] for r in rows], "s--", label="p95")
    left.axhline(80, color="grey", lw=0.8, label="real time (80 ms)")
    left.set(xlabel="live conversations", ylabel="frame round trip (ms)", xticks=n)
    left.legend()
    right.bar([str(x) for x in n], [r["frames_per_s"] for r in rows])
    right.set(xlabel="live conversations", ylabel="frames / s, all conversations")
    fig.suptitle(f"talker + code2wav on Triton, {report['machine']}, {report['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
