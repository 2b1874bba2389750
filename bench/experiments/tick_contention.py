"""A stage's tick on a GPU, alone and beside threads that take the GIL as a Triton stub's do.

Served, a stage's tick shares its process with the stub's request thread and the send lanes,
which hold the GIL for a fraction of a millisecond per frame. Every PyTorch call a tick makes
from Python lets them take it, and the tick's thread then waits for it back (up to the switch
interval, `sys.setswitchinterval`, each time). This measures that in one process: the talker's
tick (PersonaPlex's 7B architecture, random bf16 weights, CUDA graphs) and code2wav's, each
alone, then beside `--threads` threads that each take the GIL for `--hold-us` microseconds
`--rate` times a second (about what a stub does per frame at 56-64 conversations); the tick's
wall time, its thread's CPU time (a GPU wait spins on the CPU, so wall - CPU is the time off the
CPU: waiting for the GIL), and the PyTorch calls a tick makes from Python.

    python -m bench.experiments.tick_contention --tokenizer TOKENIZER.model --rows 14 --fill 3000 --out bench/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from bench.gpu_step import calls_a_tick


class GilTakers:
    """Threads that each hold the GIL for `hold_s` (pure Python work), `rate` times a second."""

    def __init__(self, threads: int, hold_s: float, rate: float):
        self.hold_s, self.period_s = hold_s, 1.0 / rate
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.perf_counter()
            while time.perf_counter() - began < self.hold_s:
                sum(i * i for i in range(50))
            time.sleep(max(0.0, self.period_s - self.hold_s))

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for thread in self._threads:
            thread.join()


def timed_ticks(tick, count: int) -> dict:
    """Wall and thread-CPU ms of `count` ticks (after 3 to warm up): medians and p99."""
    for _ in range(3):
        tick()
    wall, cpu = [], []
    for _ in range(count):
        began, began_cpu = time.perf_counter(), time.thread_time()
        tick()
        wall.append(1000 * (time.perf_counter() - began))
        cpu.append(1000 * (time.thread_time() - began_cpu))
    off = [w - c for w, c in zip(wall, cpu)]
    return {"wall_p50": round(statistics.median(wall), 2), "wall_p99": round(float(np.percentile(wall, 99)), 2),
            "off_cpu_p50": round(statistics.median(off), 2), "off_cpu_p99": round(float(np.percentile(off, 99)), 2)}


def stages(args):
    """{name: tick function} of the talker (`args.rows` of a pool, at `args.fill` frames of
    context) and code2wav (as many rows)."""
    from moshi.models import loaders as moshi_loaders
    import sentencepiece

    from bench.gpu_step import age
    from personaplex_triton.core import loaders
    from personaplex_triton.lm import kv_cache
    from personaplex_triton.lm.sampling import SamplingParams
    from personaplex_triton.mimi.runtime import TorchStepRunner
    from personaplex_triton.stages.code2wav import Code2Wav, CodesFrame
    from personaplex_triton.stages.persona import Persona, VoicePrompt
    from personaplex_triton.stages.talker import Talker, TalkerSetup

    torch.manual_seed(0)
    lm = moshi_loaders.get_moshi_lm(None, lm_kwargs=loaders.PERSONAPLEX_LM_KWARGS, device="cuda",
                                    dtype=torch.bfloat16).eval()
    mimi = moshi_loaders.get_mimi(None, device="cuda")
    tokenizer = sentencepiece.SentencePieceProcessor(str(args.tokenizer))
    rng = np.random.default_rng(0)
    voice = VoicePrompt("noise", frames=(0.1 * rng.standard_normal((2, 1920))).astype(np.float32))
    talker = Talker(lm, TorchStepRunner("encoder", mimi), tokenizer, args.pool,
                    kv_dtype=kv_cache.KV_DTYPES[args.kv_dtype])
    for s in range(args.rows):
        talker.prefill(s, TalkerSetup(Persona(voice, ()), SamplingParams(seed=s)))
    age(talker.generator, args.fill)
    frames = {s: (0.1 * rng.standard_normal(1920)).astype(np.float32) for s in range(args.rows)}
    decoder = Code2Wav(TorchStepRunner("decoder", mimi), args.pool)
    codes = {s: CodesFrame(rng.integers(0, 2048, 8)) for s in range(args.rows)}
    for s in range(args.rows):
        decoder.prefill(s)
    return {"talker": lambda: talker.tick(frames), "code2wav": lambda: decoder.tick(codes)}


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.setswitchinterval(args.switch_interval_us / 1e6)
    ticks = stages(args)
    rows = []
    for name, tick in ticks.items():
        alone = timed_ticks(tick, args.ticks)
        calls = calls_a_tick(tick)  # a tick after others: the talker's writes the last one's user codes
        with GilTakers(args.threads, args.hold_us / 1e6, args.rate):
            beside = timed_ticks(tick, args.ticks)
        rows.append({"stage": name, "calls": calls, "alone": alone, "beside": beside})
        print(rows[-1], flush=True)
    report = {"date": date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": "python -m bench.experiments.tick_contention " + " ".join(sys.argv[1:] if argv is None else argv),
              "name": args.name, "args": {k: v for k, v in vars(args).items() if k not in ("out", "tokenizer")},
              "rows": rows}
    write_report(report, args.out, args.name)
    return 0


def write_report(report: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    a = report["args"]
    lines = [f"# A tick beside threads that take the GIL ({report['date']}, {report['gpu']}, torch {report['torch']})",
             "", f"Command: `{report['command']}`. {a['rows']} rows of a {a['pool']}-slot pool, {a['fill']} frames "
             f"of context, {a['kv_dtype']} KV; beside: {a['threads']} threads each holding the GIL "
             f"{a['hold_us']} us, {a['rate']} times a second; switch interval {a['switch_interval_us']} us; "
             f"{a['ticks']} ticks each. ms.", "",
             "| stage | PyTorch calls a tick | alone: wall p50 / p99 | off the CPU p50 | beside: wall p50 / p99 "
             "| off the CPU p50 / p99 |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in report["rows"]:
        alone, beside = r["alone"], r["beside"]
        lines.append(f"| {r['stage']} | {r['calls']} | {alone['wall_p50']} / {alone['wall_p99']} | "
                     f"{alone['off_cpu_p50']} | {beside['wall_p50']} / {beside['wall_p99']} | "
                     f"{beside['off_cpu_p50']} / {beside['off_cpu_p99']} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def parse_args(argv=None) -> argparse.Namespace:
    from personaplex_triton.lm import kv_cache

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="a SentencePiece model (any)")
    parser.add_argument("--rows", type=int, default=14, help="the frames a tick carries")
    parser.add_argument("--pool", type=int, default=56, help="the talker's and code2wav's slots")
    parser.add_argument("--fill", type=int, default=3000, help="frames of context each conversation is into")
    parser.add_argument("--kv-dtype", choices=list(kv_cache.KV_DTYPES), default="float8_e4m3fn")
    parser.add_argument("--ticks", type=int, default=200)
    parser.add_argument("--threads", type=int, default=3)
    parser.add_argument("--hold-us", type=float, default=200.0)
    parser.add_argument("--rate", type=float, default=700.0)
    parser.add_argument("--switch-interval-us", type=float, default=500.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--name", default="tick_contention")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
