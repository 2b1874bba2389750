"""How many answers a second a Python-backend stub sends, by send threads (the outbox's lanes).

Each served frame's answer is a round trip from the stub to tritonserver that waits with the GIL
released. On an H100 host one thread sent up to 1,735 answers in a second, and about 450 through
the hypervisor's steal episodes while 55 conversations asked for 687 (docs/gpu-serving-log.md). This
measures the sends alone, with no model: a real tritonserver serving `bench/experiments/send_rate_repository`
(a decoupled Python model that answers each request with `--answers` responses of the served
shape, through the project's outbox and the served stages' sends), `--streams` gRPC streams
asking at once, for each lane count of `--lanes` in turn, `--rounds` times. The rate is the
server's own: the answers over the time from the first put to the last send's start. The
client checks that every stream got its answers, in order.

    python -m bench.experiments.send_rate --lanes 1 2 4 8 --streams 55 --answers 100 --rounds 5 --name send-rate-cpu2

writes bench/results/<date>-<name>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from bench import report

REPOSITORY = Path(__file__).resolve().parent / "send_rate_repository"
MODEL = "send_rate"
ROUND_TIMEOUT_S = 300.0


def inputs(count: int, lanes: int, stream: int) -> list:
    tensors = []
    for name, value in (("COUNT", count), ("LANES", lanes), ("STREAM", stream)):
        tensor = grpcclient.InferInput(name, [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], np.int32))
        tensors.append(tensor)
    return tensors


def one_round(url: str, lanes: int, streams: int, answers: int) -> dict:
    """`streams` streams ask `answers` each at once; what the server's answers say of its sends."""
    clients = [grpcclient.InferenceServerClient(url) for _ in range(streams)]
    times: list[list[np.ndarray]] = [[] for _ in range(streams)]
    errors: list[str] = []
    remaining = [streams * answers]
    lock, done = threading.Lock(), threading.Event()

    def on_answer(stream: int, result, error) -> None:
        with lock:
            if error is not None:
                errors.append(str(error))
                done.set()
                return
            times[stream].append(result.as_numpy("TIMES"))
            remaining[0] -= 1
            if remaining[0] == 0:
                done.set()

    try:
        for stream, client in enumerate(clients):
            client.start_stream(callback=functools.partial(on_answer, stream))
        for stream, client in enumerate(clients):
            client.async_stream_infer(MODEL, inputs(answers, lanes, stream))
        if not done.wait(ROUND_TIMEOUT_S):
            raise RuntimeError(f"{remaining[0]} of {streams * answers} answers not in after {ROUND_TIMEOUT_S:.0f} s")
    finally:
        for client in clients:
            client.stop_stream()
            client.close()
    if errors:
        raise RuntimeError(f"the server answered with an error: {errors[0]}")
    every = np.concatenate([np.stack(t) for t in times])
    in_order = all(bool(np.all(np.diff(np.stack(t)[:, 1]) >= 0)) for t in times)
    span_s = every[:, 1].max() - every[:, 0].min()
    return {"answers": len(every), "span_s": round(float(span_s), 4),
            "answers_per_s": round(len(every) / span_s, 1), "in_order": in_order}


def measure(url: str, lanes: list[int], streams: int, answers: int, rounds: int) -> list[dict]:
    """Each lane count `rounds` times, the counts in turn (one warm-up round each first)."""
    runs: dict[int, list[dict]] = {n: [] for n in lanes}
    for n in lanes:
        one_round(url, n, streams, answers)  # the lanes' threads start; the first sends warm up
    for _ in range(rounds):
        for n in lanes:
            runs[n].append(one_round(url, n, streams, answers))
    base = statistics.median(r["answers_per_s"] for r in runs[lanes[0]])
    rows = []
    for n in lanes:
        rates = [r["answers_per_s"] for r in runs[n]]
        rows.append({"lanes": n, "rounds": runs[n], "answers_per_s_p50": round(statistics.median(rates), 1),
                     "answers_per_s_min": min(rates), "answers_per_s_max": max(rates),
                     "vs_first": round(statistics.median(rates) / base, 2),
                     "in_order": all(r["in_order"] for r in runs[n])})
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lanes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--streams", type=int, default=55, help="streams asking at once (conversations)")
    parser.add_argument("--answers", type=int, default=100, help="answers each stream asks for")
    parser.add_argument("--rounds", type=int, default=5)
    report.add_output_arguments(parser, "send-rate")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from personaplex_triton.serving.launch import TritonServer

    args, started = parse_args(argv), report.now()
    if min(args.lanes) < 1 or args.streams < 1 or args.answers < 1 or args.rounds < 1:
        raise SystemExit("--lanes, --streams, --answers and --rounds must be at least 1")
    with tempfile.TemporaryDirectory() as folder:
        with TritonServer(REPOSITORY, log_path=Path(folder) / "tritonserver.log") as server:
            rows = measure(server.grpc_url, args.lanes, args.streams, args.answers, args.rounds)
    result = report.run_record("bench.experiments.send_rate", argv, args.commit, started, streams=args.streams,
                               answers=args.answers, rows=rows)
    report.save(result, args.out, f"{started:%Y-%m-%d}-{args.name}", markdown, plot)
    return 0


def markdown(result: dict, plot_name: str) -> str:
    first = result["rows"][0]["lanes"]
    lines = [*report.run_heading(result, "Answers a second a Python-backend stub sends, by send threads"),
             f"- {result['streams']} gRPC streams ask {result['answers']} answers each at once (1,920 float32 "
             "samples and a text piece, as served), through the outbox's lanes and the served sends "
             f"(`bench/experiments/send_rate_repository`); {len(result['rows'][0]['rounds'])} rounds a lane count, in turn, "
             "after a warm-up round each.",
             "- The rate is the server's: the answers over the time from the first put to the last send's start.", "",
             f"| send threads | answers a second, p50 (min-max) | against {first} | every stream's answers in order |",
             "| ---: | ---: | ---: | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['lanes']} | {r['answers_per_s_p50']:,.0f} ({r['answers_per_s_min']:,.0f}-"
                     f"{r['answers_per_s_max']:,.0f}) | {r['vs_first']}x | {'yes' if r['in_order'] else 'NO'} |")
    return "\n".join(lines + ["", f"![send rate]({plot_name})", ""])


def plot(result: dict, path: Path) -> None:
    plt = report.pyplot()

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    p50 = [r["answers_per_s_p50"] for r in rows]
    spread = [[m - r["answers_per_s_min"] for m, r in zip(p50, rows)],
              [r["answers_per_s_max"] - m for m, r in zip(p50, rows)]]
    ax.bar([str(r["lanes"]) for r in rows], p50, yerr=spread, capsize=4)
    ax.set_xlabel("send threads (the outbox's lanes)")
    ax.set_ylabel("answers a second (p50, min-max)")
    ax.grid(alpha=0.3, axis="y")
    report.save_figure(fig, path, f"Sends from one stub, {result['streams']} streams")


if __name__ == "__main__":
    sys.exit(main())
