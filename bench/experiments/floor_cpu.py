"""What the Python backend alone costs the host's CPU a frame: tritonserver and one stub serving
Triton's floor (`floor_repository`: the served contract answered at once from `execute`), paced
conversations at several levels, the server pinned to its own cores and the load generator (this
process, a thread a conversation) to the rest. Each level's CPU a frame by role comes from
/proc (bench/host_cpu.py), the steal from /proc/stat. Against the served runs' "host's share",
it says how much of a frame's host work any Python-backend model pays before its own.

    python -m bench.experiments.floor_cpu --conversations 8 32 64 --seconds 30
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from personaplex_stream import stream_conversation
from personaplex_triton.core import contract
from personaplex_triton.serving.launch import TritonServer

from .. import host_cpu, report, stats, steal
from ..loadgen import LOAD_GENERATOR
from .crossings import FLOOR, FLOOR_REPOSITORY


def level(server: TritonServer, conversations: int, seconds: float) -> dict:
    audio = (0.1 * np.random.default_rng(conversations).standard_normal(
        int(seconds * contract.SAMPLE_RATE))).astype(np.float32)
    before, host_before, own_before = host_cpu.snapshot(server.tritonserver_pid()), steal.cpu_times(), time.process_time()
    with ThreadPoolExecutor(conversations) as pool:
        results = list(pool.map(lambda a: stream_conversation(a, server.grpc_url, FLOOR, realtime=True),
                                [audio] * conversations))
    spent = host_cpu.cpu_by_role(before, host_cpu.snapshot(server.tritonserver_pid()))
    spent[LOAD_GENERATOR] = time.process_time() - own_before
    frames = sum(len(result.latencies_ms) for result in results)
    summary = stats.frame_summary([ms for result in results for ms in result.latencies_ms])
    return {"conversations": conversations, "frames": frames, "p50": summary["p50"], "p99": summary["p99"],
            "cpu_ms_per_frame": {name: round(1e3 * s / frames, 3) for name, s in spent.items()},
            "steal_pct": round(steal.steal_percent(host_before, steal.cpu_times()), 2)}


def write(result: dict, out: Path, stem: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    roles = sorted({role for row in levels for role in row["cpu_ms_per_frame"]})
    lines = [f"# Triton's floor: the host's CPU a frame, {result['machine']['cpu']}, {result['date']}", "",
             f"Command: `{result['command']}`; server on cores {result['server_cores']}, the load generator on "
             f"{result['load_cores']}; commit {result['commit']}.", "",
             "| conversations | frames | p50 / p99 (ms) | " + " | ".join(roles) + " | server | steal % |",
             "| ---: | ---: | ---: | " + " | ".join("---:" for _ in roles) + " | ---: | ---: |"]
    for row in levels:
        cpu = row["cpu_ms_per_frame"]
        server = sum(v for k, v in cpu.items() if k != LOAD_GENERATOR)
        lines.append(f"| {row['conversations']} | {row['frames']} | {row['p50']:.1f} / {row['p99']:.1f} | "
                     + " | ".join(f"{cpu.get(role, 0):.3f}" for role in roles)
                     + f" | {server:.3f} | {row['steal_pct']:.1f} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for role in roles:
        ax.plot([r["conversations"] for r in levels], [r["cpu_ms_per_frame"].get(role, 0) for r in levels],
                marker="o", label=role)
    ax.set_xlabel("conversations")
    ax.set_ylabel("CPU ms a frame")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=100)
    return out / f"{stem}.md"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--server-cpus", type=host_cpu.parse_cpus, default=None,
                        help="the server's cores (default: the first half of this process's)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    available = sorted(os.sched_getaffinity(0))
    server_cpus = args.server_cpus or available[:max(1, len(available) // 2)]
    load_cpus = [cpu for cpu in available if cpu not in server_cpus] or available
    machine, started = report.machine(), report.now()
    host_cpu.pin_process(os.getpid(), server_cpus)  # the server inherits them
    with tempfile.TemporaryDirectory() as folder, \
            TritonServer(FLOOR_REPOSITORY, log_path=Path(folder) / "tritonserver.log") as server:
        host_cpu.pin_process(os.getpid(), load_cpus)
        stream_conversation(np.zeros(10 * contract.FRAME_SAMPLES, np.float32), server.grpc_url, FLOOR)
        levels = []
        for conversations in args.conversations:
            levels.append(level(server, conversations, args.seconds))
            print(json.dumps(levels[-1]), flush=True)
    result = {"date": started.date().isoformat(), "command": " ".join(["python -m bench.experiments.floor_cpu",
                                                                      *argv]),
              "machine": machine, "commit": report.git_commit(), "server_cores": server_cpus,
              "load_cores": load_cpus, "levels": levels}
    args.out.mkdir(parents=True, exist_ok=True)
    print(write(result, args.out, f"{result['date']}-{machine['slug']}-floor-cpu"))


if __name__ == "__main__":
    main()
