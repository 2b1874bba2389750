"""Paced conversations run after run against two (or more) running servers taking turns, so
that a shared machine's drift falls on each: how many of the runs held real time.

Each round runs `python -m bench.run --url URL --stages load --conversations N --seconds S`
once per server, in the order given; the table has one row a run (the 1-minute load average
at its start, the CPU time the hypervisor stole during it, p50 / p95 / p99, late frames, real
time) and, per server, the median over its runs and how many held real time:

    python -m bench.runs --server before=localhost:9001 --server after=localhost:8101 --rounds 10 --name cpu-ab

writes bench/results/<date>-<name>-runs.{md,json,png}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import report
from bench.steal import StealSampler


def load_level(conversations: int, seconds: float, options: list[str]) -> dict:
    """The figures of one `bench.run --stages load` level, run in a process of its own with
    `options` (`--url`, `--one-stub`, `--trace-dir`, ...), as its JSON has them."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "bench.run", *options, "--stages", "load",
                        "--conversations", str(conversations), "--seconds", str(seconds),
                        "--out", out, "--name", "run"], check=True, capture_output=True, cwd=report.REPO_ROOT)
        return report.read_result(next(Path(out).glob(f"*{report.LOAD_RESULT_SUFFIX}")))["load"][0]


def one_run(url: str, conversations: int, seconds: float) -> dict:
    """The load level's figures of one `bench.run` against `url`, and the CPU time stolen meanwhile."""
    with StealSampler() as steal:
        level = load_level(conversations, seconds, ["--url", url])
    return {**{key: level[key] for key in ("frames", "p50", "p95", "p99", "late", "real_time")},
            "steal": steal.mean, "steal_peak": steal.peak}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", action="append", required=True, metavar="LABEL=HOST:PORT",
                        help="a running server's gRPC address, with a label (repeat it)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--conversations", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=6)
    parser.add_argument("--out", type=Path, default=report.REPO_ROOT / "bench" / "results")
    parser.add_argument("--name", default="runs")
    parser.add_argument("--note", default="", help="what each server runs, for the report")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    servers = dict(item.split("=", 1) for item in args.server)
    started = report.now()
    runs = []
    for round_ in range(1, args.rounds + 1):
        for label, url in servers.items():
            load = round(os.getloadavg()[0], 2)
            at = report.now().strftime("%H:%M:%S")
            run = {"round": round_, "server": label, "time": at, "load": load,
                   **one_run(url, args.conversations, args.seconds)}
            runs.append(run)
            print(f"{at} {label}: load {load}, steal {run['steal']}% (worst second {run['steal_peak']}%), p50 {run['p50']} ms, p99 {run['p99']} ms, late {run['late']}, "
                  f"real time {'yes' if run['real_time'] else 'no'}", flush=True)
    result = {"command": "python -m bench.runs " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": report.machine(), "commit": report.git_commit(), "started": started.isoformat(timespec="seconds"),
              "note": args.note, "conversations": args.conversations, "seconds": args.seconds,
              "servers": servers, "runs": runs, "summary": {label: summary([r for r in runs if r["server"] == label])
                                                            for label in servers}}
    report.save(result, args.out, f"{started:%Y-%m-%d}-{args.name}-runs", markdown, plot)
    return 0


def summary(runs: list[dict]) -> dict:
    return {"runs": len(runs), "real_time": sum(r["real_time"] for r in runs),
            **{f"median_{key}": round(statistics.median(r[key] for r in runs), 1) for key in ("p50", "p95", "p99", "late")}}


def markdown(result: dict, plot_name: str) -> str:
    m = result["machine"]
    lines = [f"# {result['conversations']} paced conversation(s), run after run ({result['started'][:10]}, "
             f"{m['cpu']}, {m['cores']} cores)", "",
             f"- Command: `{result['command']}`",
             f"- Commit {result['commit']} (the bench), started {result['started']} UTC",
             "- Servers: " + ", ".join(f"{label} at {url}" for label, url in result["servers"].items())
             + (f"; {result['note']}" if result["note"] else ""),
             f"- Each run: `bench.run --stages load --conversations {result['conversations']} --seconds "
             f"{result['seconds']:g}` (one frame every 80 ms); the servers take turns. Real time: p99 under 80 ms "
             "and no frame late. Load: the 1-minute load average at the run's start (2 cores; the machine is "
             "shared). Steal: % of CPU time the hypervisor gave to other guests, over the run and in its "
             "worst second (/proc/stat).", "",
             "| time (UTC) | server | load | steal: run, worst second (%) | p50 (ms) | p95 (ms) | p99 (ms) | late "
             "| real time |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for r in result["runs"]:
        steal = "n/a" if r.get("steal") is None else f"{r['steal']}, {r['steal_peak']}"
        lines.append(f"| {r['time']} | {r['server']} | {r['load']} | {steal} | {r['p50']} | {r['p95']} | {r['p99']} | "
                     f"{r['late']} of {r['frames']} | {'yes' if r['real_time'] else 'no'} |")
    lines += ["", "| server | runs in real time | median p50 (ms) | median p95 (ms) | median p99 (ms) | median late |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, s in result["summary"].items():
        lines.append(f"| {label} | {s['real_time']} of {s['runs']} | {s['median_p50']} | {s['median_p95']} | "
                     f"{s['median_p99']} | {s['median_late']} |")
    return "\n".join(lines + ["", f"![runs]({plot_name})", ""])


def plot(result: dict, path: Path) -> None:
    plt = report.pyplot()

    fig, ax = plt.subplots(figsize=(8, 4))
    for label in result["servers"]:
        runs = [r for r in result["runs"] if r["server"] == label]
        ax.plot([r["round"] for r in runs], [r["p99"] for r in runs], "o-", label=f"{label} p99")
        ax.plot([r["round"] for r in runs], [r["p50"] for r in runs], "x--", label=f"{label} p50")
    ax.axhline(80, color="grey", lw=1, ls=":", label="80 ms frame")
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel("frame latency (ms)")
    ax.set_title(f"{result['conversations']} paced conversation(s), servers taking turns")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    report.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
