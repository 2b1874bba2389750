"""Per-tick time of the two stages on a GPU, with PersonaPlex's 7B architecture (random bf16
weights) and a full-size Mimi, for several numbers of live conversations. The talker's model
step and both Mimi steps (PyTorch runtime) run under CUDA graphs (`--no-cuda-graphs`: eager,
the baseline).

    python bench/gpu_step.py --tokenizer TOKENIZER.model --slots 1 8 32 64 --out bench/results
    python bench/gpu_step.py --from-json bench/results/gpu_step.json   (table and plot again)

Writes gpu_step.{json,md,png} (gpu_step_eager.* with --no-cuda-graphs) under --out. A tick = Mimi-encode every slot's user
frame, one temporal-transformer step, the 16-codebook depformer, sampling, results on the
host (Talker.tick); code2wav = one batched streaming Mimi decode (Code2Wav.tick).
"""

import argparse
import gc
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch


def timed(fn, steps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 2)


def main():
    from moshi.models import loaders as moshi_loaders
    import sentencepiece

    from personaplex_triton import loaders
    from personaplex_triton.code2wav import Code2Wav
    from personaplex_triton.mimi_runtime import TorchStepRunner
    from personaplex_triton.persona import Persona, VoicePrompt
    from personaplex_triton.sampling import SamplingParams
    from personaplex_triton.talker import Talker, TalkerSetup

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tokenizer", type=Path, help="a SentencePiece model (any)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--from-json", type=Path, help="only render the table and plot of a result")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="eager model and Mimi steps")
    args = parser.parse_args()
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        return write_report(report, args.out, args.from_json.stem)
    if args.tokenizer is None:
        parser.error("--tokenizer is required for a run")

    torch.manual_seed(0)
    started = time.perf_counter()
    lm = moshi_loaders.get_moshi_lm(None, lm_kwargs=loaders.PERSONAPLEX_LM_KWARGS, device="cuda",
                                    dtype=torch.bfloat16)
    lm.eval()
    params = sum(p.numel() for p in lm.parameters())
    mimi = moshi_loaders.get_mimi(None, device="cuda")
    tokenizer = sentencepiece.SentencePieceProcessor(str(args.tokenizer))
    build_s = time.perf_counter() - started
    rng = np.random.default_rng(0)
    voice = VoicePrompt("noise", frames=(0.1 * rng.standard_normal((2, 1920))).astype(np.float32))

    rows = []
    for slots in args.slots:
        torch.cuda.reset_peak_memory_stats()
        graphs = not args.no_cuda_graphs
        talker = Talker(lm, TorchStepRunner("encoder", mimi, cuda_graphs=graphs), tokenizer, slots,
                        persona_cache_size=1, cuda_graphs=graphs)
        for s in range(slots):  # the first prefills the persona, the others start from the cache
            talker.start(s, TalkerSetup(Persona(voice, ()), SamplingParams(seed=s)))
        frames = {s: (0.1 * rng.standard_normal(1920)).astype(np.float32) for s in range(slots)}
        talker_ms = timed(lambda: talker.tick(frames), args.steps)
        talker.close()
        decoder = Code2Wav(TorchStepRunner("decoder", mimi, cuda_graphs=graphs), slots)
        codes = {s: rng.integers(0, 2048, 8) for s in range(slots)}
        for s in range(slots):
            decoder.start(s)
        code2wav_ms = timed(lambda: decoder.tick(codes), args.steps)
        rows.append({"slots": slots, "talker_tick_ms": talker_ms, "code2wav_tick_ms": code2wav_ms,
                     "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)})
        print(rows[-1], flush=True)
        del talker, decoder
        gc.collect()  # the CUDA graphs' memory pools go with the last reference
        torch.cuda.empty_cache()

    report = {"date": date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(),
              "lm_parameters": params, "dtype": "bfloat16", "cuda_graphs": not args.no_cuda_graphs,
              "build_s": round(build_s, 1), "steps": args.steps, "rows": rows}
    write_report(report, args.out, "gpu_step" if report["cuda_graphs"] else "gpu_step_eager")


def write_report(report, out: Path, name: str) -> None:
    rows, steps = report["rows"], report["steps"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    mode = "CUDA graphs" if report["cuda_graphs"] else "eager"
    lines = [f"# GPU tick times ({report['date']}, {report['gpu']}, torch {report['torch']}, {mode})", "",
             f"PersonaPlex 7B architecture, {report['lm_parameters'] / 1e9:.2f} B parameters, random bf16 "
             f"weights; median of {steps} ticks. Command: `python bench/gpu_step.py --tokenizer ...`.", "",
             "| live conversations | talker tick (ms) | code2wav tick (ms) | peak GPU memory (GiB) |",
             "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['slots']} | {r['talker_tick_ms']} | {r['code2wav_tick_ms']} | {r['peak_gib']} |" for r in rows]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slots = [r["slots"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(slots, [r["talker_tick_ms"] for r in rows], "o-", label="talker tick")
    ax.plot(slots, [r["code2wav_tick_ms"] for r in rows], "s-", label="code2wav tick")
    ax.axhline(80, color="grey", lw=0.8, label="real time (80 ms)")
    ax.set(xscale="log", xticks=slots, xticklabels=slots, xlabel="live conversations", ylabel="ms per tick")
    ax.legend()
    ax.set_title(f"{report['gpu']}, talker {mode}, {report['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)


if __name__ == "__main__":
    with torch.no_grad():
        main()
