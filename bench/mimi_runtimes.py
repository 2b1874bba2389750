"""Per-frame cost of Mimi's encoder and decoder on each runtime here, and the frame budget.

For batch sizes (default 1 and 8 live conversations) it times one tick of the slot pool
(`MimiSlots`, as the stages run it) on each runtime that can run on this machine, against
moshi's own streaming Mimi in eager PyTorch (what the stages ran before the export), at 1
PyTorch thread and at every core (speed-ups are against the faster of the two); then the
embedded default's whole frame for one conversation: talker tick (temporal transformer +
depformer; on a CPU the Mimi encode follows the answer, `Talker(encode_after)`) + code2wav
tick, against the 80 ms a frame lasts. The runtimes and
the frame run with the threads a stage's process uses (`serving.stage_builds.use_device_threads`).

    python -m bench.mimi_runtimes [--checkpoint DIR] [--batch 1 8] [--ticks 20] [--out bench/results]

Writes mimi_runtimes.{json,md,png} under --out (the checkpoint's export must exist: `make
export`). Medians of one run; the machine is noisy, so compare within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

os.environ.setdefault("NO_TORCH_COMPILE", "1")  # before moshi is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402

from personaplex_triton.core import loaders  # noqa: E402
from personaplex_triton.core.paths import REPO_ROOT  # noqa: E402
from personaplex_triton.mimi.artefacts import onnx_path  # noqa: E402
from personaplex_triton.mimi.runtime import RUNTIMES, RuntimeUnavailable, open_step  # noqa: E402
from personaplex_triton.mimi.stream import MimiSlots  # noqa: E402
from personaplex_triton.serving.stage_builds import use_device_threads  # noqa: E402

from . import report as run_report  # noqa: E402

MOSHI_EAGER = "moshi eager"
CORES = len(os.sched_getaffinity(0))
FRAME_MS = 80.0


def median_ms(fn, ticks: int, warmup: int = 3, before=lambda: None) -> float:
    """Median ms of `fn`; `before` runs ahead of each call, outside the timing."""
    for _ in range(warmup):
        before()
        fn()
    times = []
    for _ in range(ticks):
        before()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 2)


def inputs(stage: str, batch: int, rng) -> dict[int, np.ndarray]:
    if stage == "decoder":
        return {s: rng.integers(0, 2048, 8) for s in range(batch)}
    return {s: (0.1 * rng.standard_normal(1920)).astype(np.float32) for s in range(batch)}


def moshi_step(mimi, stage: str, items: dict[int, np.ndarray]):
    """One frame of moshi's streaming Mimi for the batch of `items` (inside mimi.streaming)."""
    x = torch.as_tensor(np.stack(list(items.values())))
    if stage == "decoder":
        return lambda: mimi.decode(x[:, :, None])
    return lambda: mimi.encode(x[:, None, :])


def time_runtimes(files, batches, ticks) -> list[dict]:
    rng = np.random.default_rng(0)
    mimi = loaders.get_mimi(files)
    rows = []
    for stage in ("encoder", "decoder"):
        runners = []
        for runtime in RUNTIMES:
            try:
                runners.append(open_step(stage, files, runtime))
            except RuntimeUnavailable as exc:
                print(f"skipping {exc}", flush=True)
        for batch in batches:
            for runner in runners:
                pool = MimiSlots(runner, max(batches))
                items = inputs(stage, batch, rng)
                step = pool.decode if stage == "decoder" else pool.encode
                ms = median_ms(lambda: step(items), ticks)
                rows.append({"stage": stage, "runtime": runner.runtime, "batch": batch, "tick_ms": ms})
                print(rows[-1], flush=True)
            served_threads = torch.get_num_threads()
            for threads in sorted({1, CORES}):
                torch.set_num_threads(threads)
                with torch.no_grad(), mimi.streaming(batch):
                    ms = median_ms(moshi_step(mimi, stage, inputs(stage, batch, rng)), ticks)
                rows.append({"stage": stage, "runtime": moshi_label(threads), "batch": batch, "tick_ms": ms})
                print(rows[-1], flush=True)
            torch.set_num_threads(served_threads)
    return rows


# ops whose weights every step reads whole (a codebook Gather reads a few rows)
WEIGHT_READING_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "MatMulNBits"}


def weights_read_mb(path: Path) -> float:
    """MB of the exported step's weights that a step reads whole, whatever its batch."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    sizes = {t.name: np.prod(t.dims) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
             for t in model.graph.initializer}
    read = {name for node in model.graph.node if node.op_type in WEIGHT_READING_OPS
            for name in node.input if name in sizes}
    return round(sum(sizes[name] for name in read) / 1e6, 1)


def memory_read_gbs(threads: int, mb: int = 512, reps: int = 15) -> float:
    """GB/s at which `threads` threads read a buffer far larger than the caches (a sum)."""
    served_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    buffer = torch.ones(mb * 250_000)
    seconds = median_ms(buffer.sum, reps) / 1000
    torch.set_num_threads(served_threads)
    return round(mb / 1000 / seconds, 1)


def weight_read_floor(files, rows: list[dict]) -> list[dict]:
    """What bounds a batch-1 step: every step reads all its weights, so no step can be faster
    than reading them at the memory bandwidth of every core (ONNX Runtime's threads; moshi's
    faster count)."""
    if not any(r["batch"] == 1 for r in rows):
        return []
    threads = CORES
    gbs = memory_read_gbs(threads)
    floors = []
    for stage in ("encoder", "decoder"):
        batch1 = {r["runtime"]: r["tick_ms"] for r in rows if r["stage"] == stage and r["batch"] == 1}
        mb = weights_read_mb(onnx_path(files.mimi, stage))
        floor_ms = round(mb / gbs, 2)
        moshi_ms = min(ms for runtime, ms in batch1.items() if runtime.startswith(MOSHI_EAGER))
        floors.append({"stage": stage, "weights_mb": mb, "threads": threads, "memory_gbs": gbs, "floor_ms": floor_ms,
                       "onnxruntime_ms": batch1.get("onnxruntime"), "moshi_ms": moshi_ms,
                       "best_speed_up": round(moshi_ms / floor_ms, 1)})
        print(floors[-1], flush=True)
    return floors


def moshi_label(threads: int) -> str:
    return f"{MOSHI_EAGER}, {threads} thread{'s' if threads > 1 else ''}"


def time_frame_budget(files, ticks) -> dict:
    """One live conversation of the embedded default, as served: its stages' ticks."""
    from personaplex_triton.lm.sampling import SamplingParams
    from personaplex_triton.stages.code2wav import Code2Wav, CodesFrame
    from personaplex_triton.stages.persona import Persona, VoicePrompt
    from personaplex_triton.stages.talker import Talker, TalkerSetup

    rng = np.random.default_rng(1)
    encoder, decoder = open_step("encoder", files), open_step("decoder", files)
    talker = Talker(loaders.get_lm(files), encoder, loaders.get_tokenizer(files), 1)
    voice = VoicePrompt("noise", frames=(0.1 * rng.standard_normal((2, 1920))).astype(np.float32))
    talker.prefill(0, TalkerSetup(Persona(voice, ()), SamplingParams(seed=0)))
    frame = {0: (0.1 * rng.standard_normal(1920)).astype(np.float32)}
    # the last frame's encode is done before the next frame comes (80 ms later), as served
    talker_ms = median_ms(lambda: talker.tick(frame), ticks, before=talker.settle)
    encode_ms = median_ms(lambda: talker.mimi.encode(frame), ticks, before=talker.settle)
    encode_after = talker._encoder is not None
    talker.close()
    code2wav = Code2Wav(decoder, 1)
    code2wav.prefill(0)
    codes = {0: CodesFrame(rng.integers(0, 2048, 8))}
    decode_ms = median_ms(lambda: code2wav.tick(codes), ticks)
    total = round(talker_ms + decode_ms, 2)
    return {"encoder": encoder.runtime, "decoder": decoder.runtime, "encode_after": encode_after,
            "talker_tick_ms": talker_ms, "encode_ms": encode_ms,
            "lm_ms": round(talker_ms - (0 if encode_after else encode_ms), 2), "decode_ms": decode_ms,
            "frame_ms": total, "cpu_ms": round(total + (encode_ms if encode_after else 0), 2),
            "real_time_factor": round(total / FRAME_MS, 2)}


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "mimi_runtimes.json").write_text(json.dumps(report, indent=2) + "\n")
    rows, batches = report["rows"], report["batches"]
    runtimes = list(dict.fromkeys(r["runtime"] for r in rows))
    tick = {(r["stage"], r["runtime"], r["batch"]): r["tick_ms"] for r in rows}
    moshi = {(stage, b): min(ms for (st, runtime, bb), ms in tick.items()
                             if st == stage and bb == b and runtime.startswith(MOSHI_EAGER))
             for stage in ("encoder", "decoder") for b in batches}
    lines = [f"# Mimi per-frame cost by runtime ({report['date']}, {report['machine']})", "",
             f"Checkpoint `{report['checkpoint']}` (full-size Mimi), commit {report['commit']}; "
             f"median ms of {report['ticks']} ticks of the slot pool, every conversation with a frame; "
             f"load average {report['load_average']} at the start. Command: `{report['command']}`.", "",
             "| stage | runtime | " + " | ".join(f"batch {b}: tick (ms) | per frame (ms)" for b in batches)
             + " | speed-up vs moshi eager (its faster thread count), batch " + ", ".join(map(str, batches)) + " |",
             "| --- | --- | " + " | ".join("---: | ---:" for _ in batches) + " | ---: |"]
    for stage in ("encoder", "decoder"):
        for runtime in runtimes:
            cells = [f"{tick[stage, runtime, b]} | {tick[stage, runtime, b] / b:.2f}" for b in batches]
            ratios = ", ".join(f"{moshi[stage, b] / tick[stage, runtime, b]:.1f}x" for b in batches)
            lines.append(f"| {stage} | {runtime} | " + " | ".join(cells) + f" | {ratios} |")
    floors = report["weight_read_floor"]
    if floors:
        lines += ["", "What bounds batch 1: a step reads all its fp32 weights, so at this machine's memory "
                  f"bandwidth ({floors[0]['threads']} threads summing a 512 MB buffer) no step can take "
                  "less than the floor:", "",
                  "| stage | weights read a step (MB) | memory read (GB/s) | floor (ms) | onnxruntime (ms) "
                  "| moshi eager (ms) | best possible speed-up |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {f['stage']} | {f['weights_mb']} | {f['memory_gbs']} | {f['floor_ms']} "
                  f"| {f['onnxruntime_ms']} | {f['moshi_ms']} | {f['best_speed_up']}x |" for f in floors]
    budget = report["frame_budget"]
    after = " (after the answer)" if budget["encode_after"] else ""
    lines += ["", f"One live conversation of the embedded default (Mimi encoder on {budget['encoder']}, "
              f"decoder on {budget['decoder']}), ms per 80 ms frame; a frame waits for the talker tick "
              f"and the decode{', not the encode' if after else ''}:", "",
              f"| Mimi encode{after} | LM (temporal + depformer) | talker tick | Mimi decode "
              "| frame (tick + decode) | x real time | CPU per frame |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
              f"| {budget['encode_ms']} | {budget['lm_ms']} | {budget['talker_tick_ms']} | {budget['decode_ms']} "
              f"| {budget['frame_ms']} | {budget['real_time_factor']} | {budget['cpu_ms']} |"]
    (out / "mimi_runtimes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    width = 0.8 / len(runtimes)
    for ax, stage in zip(axes, ("encoder", "decoder")):
        for i, runtime in enumerate(runtimes):
            per_frame = [tick[stage, runtime, b] / b for b in batches]
            ax.bar(np.arange(len(batches)) + i * width, per_frame, width, label=runtime)
        ax.set(xticks=np.arange(len(batches)) + width * (len(runtimes) - 1) / 2,
               xticklabels=[f"batch {b}" for b in batches], title=f"Mimi {stage}")
    axes[0].set_ylabel("ms per frame")
    axes[0].legend(fontsize=8)
    run_report.save_figure(fig, out / "mimi_runtimes.png", f"{report['machine']}, {report['date']}", fontsize=8, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="default: the one served")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ticks", type=int, default=20)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    files = loaders.resolve_checkpoint(loaders.checkpoint_spec(args.checkpoint or ""))
    machine = run_report.machine()
    use_device_threads("cpu")
    report = {"date": date.today().isoformat(), "load_average": round(os.getloadavg()[0], 2),
              "machine": f"{machine['cpu']}, {machine['cores']} cores, torch threads {torch.get_num_threads()} "
                         f"(moshi eager: 1 and {CORES})",
              "checkpoint": run_report.checkpoint_label(str(files.root)),
              "commit": run_report.git_commit(), "torch": torch.__version__, "batches": args.batch, "ticks": args.ticks,
              "command": " ".join(["python -m bench.mimi_runtimes", *(sys.argv[1:] if argv is None else argv)]),
              "rows": time_runtimes(files, args.batch, args.ticks),
              "frame_budget": time_frame_budget(files, args.ticks)}
    report["weight_read_floor"] = weight_read_floor(files, report["rows"])
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
