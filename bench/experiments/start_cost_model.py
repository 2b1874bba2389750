"""What a new persona's start costs the live conversations: a model of the engine's loop, with
the start's pieces between the ticks. A model, not a measurement.

The engine runs one piece of a start a pass, then a tick of every conversation's oldest waiting
frame (engine/engine_loop.py), so each piece holds the live conversations' frames for its
length. The model: `--conversations` paced conversations (an 80 ms frame each, random phases,
1 ms jitter); a tick costs `--tick-fixed-ms` + `--tick-per-frame-ms` a frame (the H100's served
talker at 55 with fp8 KV: 14.3 ms for 10 frames, 5f53eaa); a frame is answered `--after-ms`
after its tick ends (code2wav's tick, the sends and the hops: 8.1 ms there, which brings the
model's median to the run's, 30 ms); a start every `--start-every-s`, of `--pieces` pieces of
each `--piece-ms` given, a piece run at most once in `--spacing` passes. For each piece length:
the live conversations' frames over 80 ms within 1 s of a start, per start, and elsewhere, and
the start's length (what a newcomer waits for its first answer, less the trip).

    python -m bench.experiments.start_cost_model --piece-ms 31 18 13

writes bench/results/<date>-start-cost-model-<name>.{md,json,png}. Checked against the H100's
55 x 240 s run (5f53eaa: 3 pieces of about 31 ms, 42 late frames of the others a start).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from bench import report

FRAME_MS = 80.0


def simulate(conversations: int, seconds: float, tick_fixed_ms: float, tick_per_frame_ms: float, after_ms: float,
             start_every_s: float, pieces: int, piece_ms: float, spacing: int = 1, seed: int = 0) -> dict:
    """Latencies of the live conversations' frames, and the starts' spans, in one run."""
    rng = np.random.default_rng(seed)
    phases = rng.uniform(0, FRAME_MS, conversations)
    frames = int(seconds * 1000 / FRAME_MS)
    arrivals = np.sort((phases[:, None] + FRAME_MS * np.arange(frames)[None, :]
                        + rng.normal(0, 1.0, (conversations, frames))).ravel())
    start_times = list(np.arange(start_every_s, seconds, start_every_s) * 1000)
    starts = list(start_times)  # those not yet begun
    waiting: list[float] = []  # arrival times not yet ticked (a conversation has one at most: a model)
    t, i, left, since_piece = 0.0, 0, 0, spacing
    began, spans, sent, latencies = None, [], [], []
    while i < len(arrivals) or waiting:
        while i < len(arrivals) and arrivals[i] <= t:
            waiting.append(arrivals[i])
            i += 1
        if starts and starts[0] <= t and not left:  # a start begins: its pieces from this pass on
            began, left = starts.pop(0), pieces
        ran = False
        if left and since_piece >= spacing:
            t += piece_ms
            left, since_piece, ran = left - 1, 0, True
            if not left:
                spans.append(t - began)
        if waiting:
            t += tick_fixed_ms + tick_per_frame_ms * len(waiting)
            sent.extend(waiting)
            latencies.extend(t + after_ms - a for a in waiting)
            waiting = []
            since_piece += 1
        elif not ran:
            t = arrivals[i] if i < len(arrivals) else t
            since_piece = spacing
    return {"sent": np.array(sent), "latencies": np.array(latencies), "spans": spans,
            "starts": start_times}


def summary(run: dict) -> dict:
    sent, lat, starts = run["sent"], run["latencies"], np.array(run["starts"])
    near = np.zeros(len(sent), bool)
    for s in starts:
        near |= (sent >= s - 1000) & (sent < s + 1000)
    late = lat > 80
    return {"p50": round(float(np.median(lat)), 1), "p99": round(float(np.percentile(lat, 99)), 1),
            "late_near_a_start": round(float(late[near].sum()) / max(len(starts), 1), 1),
            "late_elsewhere": int(late[~near].sum()), "frames": int(len(lat)),
            "start_ms": round(float(np.median(run["spans"])), 1) if run["spans"] else None}


def around_starts(run: dict, bin_ms: float = 50.0, before_ms: float = 200.0, after_ms: float = 800.0) -> dict:
    """The live frames' p99 latency by when they were sent, relative to the nearest start, in bins."""
    sent, lat, starts = run["sent"], run["latencies"], np.array(run["starts"])
    offset = sent - starts[np.abs(sent[:, None] - starts[None, :]).argmin(axis=1)]
    edges = np.arange(-before_ms, after_ms + bin_ms, bin_ms)
    p99 = [float(np.percentile(lat[(offset >= lo) & (offset < lo + bin_ms)], 99)) for lo in edges[:-1]]
    return {"from_ms": [float(e) for e in edges[:-1]], "p99": [round(v, 1) for v in p99]}


def markdown(result: dict, plot_name: str) -> str:
    a = result["model"]
    lines = [*report.run_heading(result, "A new persona's start: what its pieces cost the live conversations (a model)"),
             "", f"{a['conversations']} conversations for {a['seconds']:g} s, a start every {a['start_every_s']:g} s "
             f"of {a['pieces']} pieces; a tick {a['tick_fixed_ms']} ms + {a['tick_per_frame_ms']} ms a frame; "
             f"answered {a['after_ms']} ms after its tick; a piece at most once in {a['spacing']} pass(es). "
             "A model, not a measurement.", "",
             "| piece (ms) | p50 (ms) | p99 (ms) | others' frames over 80 ms within 1 s of a start, per start | "
             "over 80 ms elsewhere | a start (ms) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["rows"]:
        lines.append(f"| {row['piece_ms']:g} | {row['p50']} | {row['p99']} | {row['late_near_a_start']} | "
                     f"{row['late_elsewhere']} of {row['frames']} | {row['start_ms']} |")
    return "\n".join(lines + ["", f"![{plot_name}]({plot_name})", ""])


def plot(result: dict, path: Path) -> None:
    plt = report.pyplot()

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for row in result["rows"]:
        ax.plot(row["around_starts"]["from_ms"], row["around_starts"]["p99"], marker="o", label=f"pieces of {row['piece_ms']:g} ms")
    ax.axhline(80, color="grey", linestyle="--", linewidth=1)
    ax.axvline(0, color="grey", linewidth=1)
    ax.set_xlabel("frame sent, ms after a start began (50 ms bins)")
    ax.set_ylabel("p99 latency (ms)")
    ax.legend()
    report.save_figure(fig, path, "Live frames around a new persona's start (a model)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=55)
    parser.add_argument("--seconds", type=float, default=240.0)
    parser.add_argument("--tick-fixed-ms", type=float, default=10.5)
    parser.add_argument("--tick-per-frame-ms", type=float, default=0.38)
    parser.add_argument("--after-ms", type=float, default=8.1)
    parser.add_argument("--start-every-s", type=float, default=30.0)
    parser.add_argument("--pieces", type=int, default=3)
    parser.add_argument("--piece-ms", type=float, nargs="+", default=[31.0, 18.0, 13.0])
    parser.add_argument("--spacing", type=int, default=1)
    report.add_output_arguments(parser, "h100-n55")
    args = parser.parse_args(argv)
    model = {key: getattr(args, key) for key in ("conversations", "seconds", "tick_fixed_ms", "tick_per_frame_ms",
                                                 "after_ms", "start_every_s", "pieces", "spacing")}
    started = report.now()
    rows = []
    for piece_ms in args.piece_ms:
        run = simulate(**model, piece_ms=piece_ms)
        rows.append({"piece_ms": piece_ms, **summary(run), "around_starts": around_starts(run)})
    result = report.run_record("bench.experiments.start_cost_model", argv, args.commit, started, model=model, rows=rows)
    report.save(result, args.out, f"{started:%Y-%m-%d}-start-cost-model-{args.name}", markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
