"""In which order a tick's answers should leave: what a served run's conversations show, and a
model of the two orders.

A Python-backend stub sends one response at a time, so a tick's answers leave one after
another: the frame sent last waits for every send before it. Until the scheduler sent them
oldest frame first, they left in the conversations' join order, so the last conversations to
join always waited longest.

- `--result`: a `bench.run` result (its first load level): each long conversation's p50, p99
  and frames over 80 ms by the order the conversations started in, in quarters. In join order
  the later quarters are later.
- The model: `--conversations` paced conversations (an 80 ms frame each, random phases, 1 ms
  jitter); talker ticks back to back, each carrying every waiting conversation's oldest frame,
  at `--tick-fixed-ms` + `--tick-per-frame-ms` a frame (the H200's served talker: 17.4 ms for
  14.5 frames at 64, a8cdabc); the tick's answers sent one after another, `--send-ms` apiece;
  code2wav gathers the whole tick (its tick starts after the last of those sends, as served),
  ticks for `--code2wav-tick-ms` and sends its answers in the order they arrived,
  `--code2wav-send-ms` apiece; `--other-ms` for the rest of the trip (the hops; by default what
  brings the model's median near the run's, 45 ms). The send times are a8cdabc's send segments'
  medians over the middle of a 15-frame tick. So the order that counts is code2wav's, which
  follows the talker's. Join order against oldest first: p50, p99, frames over 80 ms, and the p99
  of the first and the last conversation to join. A model, not a measurement.

    python -m bench.experiments.send_order --result bench/results/2026-12-05-h200-n64-240s-bf16.json.xz --name h200-a8cdabc

writes bench/results/<date>-send-order-<name>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from bench import report

ORDERS = ("join order", "oldest first")


def by_start_quarter(level: dict, min_frames: int = 1000) -> list[dict]:
    """A load level's conversations of at least `min_frames` frames, in the order they started
    (their phase within the frame too, where the result has it), cut in quarters: each quarter's mean of its conversations' p50 and p99, and its share of
    frames over 80 ms."""
    talks = sorted(((c["start_s"] + c.get("phase_ms", 0) / 1000, np.asarray(lat, float))
                    for c, lat in zip(level["per_conversation"], level["latencies_ms"]) if len(lat) >= min_frames),
                   key=lambda talk: talk[0])
    quarters = np.array_split(np.arange(len(talks)), 4)
    rows = []
    for i, members in enumerate(quarters, 1):
        lats = [talks[m][1] for m in members]
        rows.append({"quarter": i, "conversations": len(lats),
                     "p50": round(float(np.mean([np.median(x) for x in lats])), 1),
                     "p99": round(float(np.mean([np.percentile(x, 99) for x in lats])), 1),
                     "late_pct": round(100 * float(np.mean(np.concatenate(lats) > 80)), 2)})
    return rows


def simulate(conversations: int, seconds: float, oldest_first: bool, tick_fixed_ms: float, tick_per_frame_ms: float,
             send_ms: float, code2wav_tick_ms: float, code2wav_send_ms: float, other_ms: float,
             seed: int = 0) -> dict:
    """The model above, one order: p50, p99, % over 80 ms, and the first and last joiner's p99."""
    rng = np.random.default_rng(seed)
    phases = rng.uniform(0, 80, conversations)
    frames = int(seconds * 1000 / 80)
    arrivals = sorted((phases[c] + 80 * k + rng.normal(0, 1), c) for c in range(conversations) for k in range(frames))
    per_conversation: list[list[float]] = [[] for _ in range(conversations)]
    waiting: list[tuple[float, int]] = []
    now, next_arrival = 0.0, 0
    while next_arrival < len(arrivals) or waiting:
        while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= now:
            waiting.append(arrivals[next_arrival])
            next_arrival += 1
        if not waiting:
            now = arrivals[next_arrival][0]
            continue
        tick, seen, later = [], set(), []
        for frame in waiting:  # each conversation's oldest frame
            (later if frame[1] in seen else tick).append(frame)
            seen.add(frame[1])
        waiting = later
        end = now + tick_fixed_ms + tick_per_frame_ms * len(tick)
        tick.sort(key=(lambda frame: frame[0]) if oldest_first else (lambda frame: frame[1]))
        decoded = end + len(tick) * send_ms + code2wav_tick_ms  # code2wav waits for the tick's last answer
        for position, (arrived, conversation) in enumerate(tick, 1):
            answered = decoded + position * code2wav_send_ms + other_ms
            per_conversation[conversation].append(answered - arrived)
        now = end
    latencies = np.concatenate([np.asarray(x) for x in per_conversation])
    return {"p50": round(float(np.median(latencies)), 1), "p99": round(float(np.percentile(latencies, 99)), 1),
            "late_pct": round(100 * float(np.mean(latencies > 80)), 2),
            "first_joiner_p99": round(float(np.percentile(per_conversation[0], 99)), 1),
            "last_joiner_p99": round(float(np.percentile(per_conversation[-1], 99)), 1)}


def markdown(result: dict, plot_name: str) -> str:
    lines = [*report.run_heading(result, "A tick's answers: in which order they leave"), ""]
    if result["measured"]:
        lines += [f"## Measured: {result['measured_from']}, by the order the conversations started", "",
                  "| quarter | conversations | p50 (ms, mean) | p99 (ms, mean) | over 80 ms |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['quarter']} | {r['conversations']} | {r['p50']} | {r['p99']} | {r['late_pct']}% |"
                  for r in result["measured"]]
        lines.append("")
    m = result["model"]
    lines += ["## The model (not a measurement)", "",
              f"{m['conversations']} conversations for {m['seconds']:g} s; a tick {m['tick_fixed_ms']} ms + "
              f"{m['tick_per_frame_ms']} ms a frame; the talker's sends {m['send_ms']} ms apiece, one after another; "
              f"code2wav's tick, {m['code2wav_tick_ms']} ms, after the last of them (it gathers the talker's tick), "
              f"then its sends, {m['code2wav_send_ms']} ms apiece in the order its frames arrived; the rest of the "
              f"trip {m['other_ms']} ms.", "",
              "| order | p50 (ms) | p99 (ms) | over 80 ms | first joiner's p99 (ms) | last joiner's p99 (ms) |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {order} | {r['p50']} | {r['p99']} | {r['late_pct']}% | {r['first_joiner_p99']} | "
              f"{r['last_joiner_p99']} |" for order, r in result["orders"].items()]
    return "\n".join(lines + ["", f"![{plot_name}]({plot_name})", ""])


def plot(result: dict, path: Path) -> None:
    plt = report.pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.5))
    if result["measured"]:
        ax.plot([r["quarter"] for r in result["measured"]], [r["p99"] for r in result["measured"]], marker="o",
                label="measured: mean p99 by start quarter")
    for order, r in result["orders"].items():
        ax.plot([1, 4], [r["first_joiner_p99"], r["last_joiner_p99"]], marker="x", linestyle="--",
                label=f"model, {order}: first and last joiner's p99")
    ax.set(xlabel="conversations in the order they joined (quarter)", ylabel="p99 (ms)", xticks=[1, 2, 3, 4])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    report.save_figure(fig, path, "A tick's answers, join order against oldest first", fontsize=9)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--result", type=Path, help="a bench.run result (.json.xz, or .json): its first level, by start quarter")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--tick-fixed-ms", type=float, default=11.9)
    parser.add_argument("--tick-per-frame-ms", type=float, default=0.38)
    parser.add_argument("--send-ms", type=float, default=0.65)
    parser.add_argument("--code2wav-tick-ms", type=float, default=3.5)
    parser.add_argument("--code2wav-send-ms", type=float, default=0.45)
    parser.add_argument("--other-ms", type=float, default=4.0)
    report.add_output_arguments(parser, "model")
    args = parser.parse_args(argv)
    model = {key: getattr(args, key) for key in ("conversations", "seconds", "tick_fixed_ms", "tick_per_frame_ms",
                                                 "send_ms", "code2wav_tick_ms", "code2wav_send_ms", "other_ms")}
    measured = by_start_quarter(report.read_result(args.result)["load"][0]) if args.result else []
    started = report.now()
    result = report.run_record("bench.experiments.send_order", argv, args.commit, started, model=model, measured=measured,
                               measured_from=str(args.result) if args.result else None,
                               orders={order: simulate(**model, oldest_first=order == ORDERS[1]) for order in ORDERS})
    report.save(result, args.out, f"{started:%Y-%m-%d}-send-order-{args.name}", markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
