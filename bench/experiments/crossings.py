"""What Triton adds to a frame, the two stages in two stubs, in one, and in one tick: paced
conversations through each server in turn, their frames followed through the stages.

Each round runs `python -m bench.run --stages load --conversations N --seconds S --trace-dir DIR`
once on `model_repository` (talker and code2wav, two Python stubs: a frame crosses between
tritonserver and a stub four times), and once with `--one-stub` (`speech`: twice; one engine's
tick steps both stages, "one tick"), each starting its own server. Per server, the median over rounds
of each segment of a frame's trip (core/trace.py) and of their sum outside the two ticks: what
Triton, the stubs and the hand-off between the stages add.

With `--floor`, each round also runs the same paced conversations through Triton's floor
(`bench/experiments/floor_repository`: a decoupled Python model of the served contract that answers each
frame at once from execute, with no model behind it): what tritonserver, gRPC and one Python
stub cost a frame whatever the project does, so the rest of "outside the two ticks" is ours.

    python -m bench.experiments.crossings --rounds 3 --seconds 30 --name cpu2-intel-xeon
    python -m bench.experiments.crossings --repositories "one tick" --floor --rounds 1 --seconds 20

writes bench/results/<date>-<name>-crossings.{md,json,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench import report, stats
from bench.runs import load_level
from personaplex_triton.core import contract
from personaplex_triton.core.trace import SEGMENTS

FLOOR_REPOSITORY = Path(__file__).resolve().parent / "floor_repository"
FLOOR = "floor"  # the label of the floor's runs
FLOOR_WARM_FRAMES = 25  # a conversation first, unmeasured: the stub's first sends warm up

# label: bench.run's options, each setting what it compares (a repository's defaults may change)
REPOSITORIES = {"two stubs": [], "one tick": ["--one-stub"]}
SERVERS = {"two stubs": "model_repository (two stubs)",
           "two engines": "model_repository_one_stub with `speech.one_tick=false` (one stub, an engine a stage)",
           "one tick": "model_repository_one_stub (one stub, one engine: the "
                       "talker's tick ends where the decode begins, and nothing waits between them)",
           # before 2026-12-06's one tick: one stub, an engine a stage
           "one stub": "model_repository_one_stub (one stub)"}
TICKS = ("talker tick", "code2wav tick")


def one_run(options: list[str], conversations: int, seconds: float) -> dict:
    """One `bench.run` load level on a server of its own: the frame figures and segment medians."""
    with tempfile.TemporaryDirectory() as traces:
        level = load_level(conversations, seconds, [*options, "--trace-dir", traces])
    segments = {name: level["trace"]["segments_ms"][name]["p50"] for name, _, _ in SEGMENTS}
    return {**{key: level[key] for key in ("frames", "p50", "p95", "p99", "late")}, "segments_ms": segments,
            "outside_ticks_ms": round(sum(ms for name, ms in segments.items() if name not in TICKS), 2)}


def floor_run(conversations: int, seconds: float) -> dict:
    """`conversations` paced conversations of `seconds` through Triton's floor, on a server of its
    own, with the project's client (frames one per 80 ms, as bench.run's load sends them)."""
    from personaplex_stream import stream_conversation
    from personaplex_triton.serving.launch import TritonServer

    rng = np.random.default_rng(0)
    audio = (0.1 * rng.standard_normal(int(seconds * contract.SAMPLE_RATE))).astype(np.float32)
    with tempfile.TemporaryDirectory() as folder, \
            TritonServer(FLOOR_REPOSITORY, log_path=Path(folder) / "tritonserver.log") as server:
        def talk(frames: np.ndarray):
            return stream_conversation(frames, server.grpc_url, FLOOR, realtime=True)
        talk(audio[:FLOOR_WARM_FRAMES * contract.FRAME_SAMPLES])
        with ThreadPoolExecutor(conversations) as pool:
            results = list(pool.map(talk, [audio] * conversations))
    latencies = [ms for result in results for ms in result.latencies_ms]
    summary = stats.frame_summary(latencies)
    return {**{key: summary[key] for key in ("frames", "p50", "p95", "p99", "late")}, "segments_ms": None,
            "outside_ticks_ms": summary["p50"]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--repositories", nargs="+", choices=list(REPOSITORIES), default=list(REPOSITORIES),
                        help="which servers take turns (default: all)")
    parser.add_argument("--floor", action="store_true",
                        help="also Triton's floor each round (bench/experiments/floor_repository: a model that answers at once)")
    parser.add_argument("--out", type=Path, default=report.REPO_ROOT / "bench" / "results")
    parser.add_argument("--name", default=report.machine()["slug"])
    parser.add_argument("--commit", help="the tree measured, for the header (default: git's; a copied checkout's "
                                         "history can be stale)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = report.now()
    runs = []
    for round_ in range(1, args.rounds + 1):
        for label in args.repositories:
            run = {"round": round_, "repository": label,
                   **one_run(REPOSITORIES[label], args.conversations, args.seconds)}
            runs.append(run)
            print(f"{report.now():%H:%M:%S} round {round_}, {label}: p50 {run['p50']} ms, outside the ticks "
                  f"{run['outside_ticks_ms']} ms", file=sys.stderr, flush=True)
        if args.floor:
            runs.append({"round": round_, "repository": FLOOR, **floor_run(args.conversations, args.seconds)})
            print(f"{report.now():%H:%M:%S} round {round_}, {FLOOR}: p50 {runs[-1]['p50']} ms", file=sys.stderr,
                  flush=True)
    labels = [*args.repositories, *([FLOOR] if args.floor else [])]
    result = report.run_record("bench.experiments.crossings", argv, args.commit, started, conversations=args.conversations,
                               seconds=args.seconds, runs=runs,
                               summary={label: summary([r for r in runs if r["repository"] == label])
                                        for label in labels})
    report.save(result, args.out, f"{started:%Y-%m-%d}-{args.name}-crossings", markdown, plot)
    return 0


def summary(runs: list[dict]) -> dict:
    median = lambda values: round(statistics.median(values), 2)
    traced = runs[0]["segments_ms"] is not None  # the floor's runs have no stages to trace
    return {"runs": len(runs), "p50": median(r["p50"] for r in runs), "p99": median(r["p99"] for r in runs),
            "outside_ticks_ms": median(r["outside_ticks_ms"] for r in runs),
            "segments_ms": {name: median(r["segments_ms"][name] for r in runs) for name, _, _ in SEGMENTS}
            if traced else None}


def markdown(result: dict, plot_name: str) -> str:
    summaries = {label: s for label, s in result["summary"].items() if s["segments_ms"] is not None}
    floor = result["summary"].get(FLOOR)
    labels = list(summaries)
    lines = [*report.run_heading(result, "What Triton adds to a frame: " + ", ".join(labels)),
             f"- Each run: `bench.run --stages load --conversations {result['conversations']} --seconds "
             f"{result['seconds']:g} --trace-dir DIR` on a server of its own, taking turns: "
             + ", ".join(SERVERS[label] for label in labels) + "; each segment's median over the run's frames, "
             "then the median over the runs.", "",
             "| segment (median ms) | " + " | ".join(labels) + " |", "| --- |" + " ---: |" * len(labels)]
    for name, _, _ in SEGMENTS:
        lines.append(f"| {name} | " + " | ".join(str(summaries[label]["segments_ms"][name]) for label in labels) + " |")
    lines += ["| **outside the two ticks** | " + " | ".join(f"**{summaries[label]['outside_ticks_ms']}**"
                                                          for label in labels) + " |",
              "| frame p50 / p99 | " + " | ".join(f"{summaries[label]['p50']} / {summaries[label]['p99']}"
                                                 for label in labels) + " |"]
    if floor is not None:
        lines += ["", f"Triton's floor (`bench/experiments/floor_repository`: the served contract, each frame answered at once "
                      f"from a Python stub's execute, no model behind it; the same client and pacing), frame p50 / p99: "
                      f"**{floor['p50']}** / {floor['p99']} ms. Above it, outside the ticks: "
                  + ", ".join(f"{label} {round(summaries[label]['outside_ticks_ms'] - floor['p50'], 2)} ms"
                              for label in labels) + "."]
    lines += ["", "Each run:", "", "| round | repository | frames | p50 / p95 / p99 (ms) | late | outside the ticks (ms) |",
              "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in result["runs"]:
        outside = "-" if r["segments_ms"] is None else r["outside_ticks_ms"]
        lines.append(f"| {r['round']} | {r['repository']} | {r['frames']} | {r['p50']} / {r['p95']} / {r['p99']} | "
                     f"{r['late']} | {outside} |")
    return "\n".join(lines + ["", f"![crossings]({plot_name})", ""])


def plot(result: dict, path: Path) -> None:
    plt = report.pyplot()

    names = [name for name, _, _ in SEGMENTS if name not in TICKS]
    summaries = {label: s for label, s in result["summary"].items() if s["segments_ms"] is not None}
    floor = result["summary"].get(FLOOR)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(summaries)
    for i, (label, s) in enumerate(summaries.items()):
        ax.bar([x + i * width for x in range(len(names))], [s["segments_ms"][n] for n in names], width,
               label=f"{label}: {s['outside_ticks_ms']} ms outside the ticks")
    ax.set_xticks([x + width * (len(summaries) - 1) / 2 for x in range(len(names))])
    ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("median ms a frame")
    ax.set_title(f"A frame's trip outside the ticks, {result['conversations']} conversation(s), "
                 f"{result['machine']['cores']} cores" + (f"; Triton's floor p50 {floor['p50']} ms" if floor else ""))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    report.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
