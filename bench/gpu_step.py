"""Per-tick time of the two stages on a GPU, with PersonaPlex's 7B architecture (random bf16
weights) and a full-size Mimi, for several numbers of live conversations. The talker's model
step and both Mimi steps (PyTorch runtime) run under CUDA graphs (`--no-cuda-graphs`: eager,
the baseline).

    python bench/gpu_step.py --tokenizer TOKENIZER.model --slots 1 8 16 32 64 --fill 400 3000 --out bench/results
    python bench/gpu_step.py --from-json bench/results/gpu_step.json   (table and plot again)

Writes gpu_step.{json,md,png} (gpu_step_eager.* with --no-cuda-graphs) under --out. A tick =
Mimi-encode every slot's user frame, one temporal-transformer step, the 16-codebook depformer,
sampling, results on the host (Talker.tick); code2wav = one batched streaming Mimi decode
(Code2Wav.tick). Both attentions (ring_attention.py and moshi's) at each context fill, and
their greedy samples from the same states (`attention_agreement`).
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


def age(talker, frames: int) -> None:
    """Put every slot `frames` frames into its conversation, as far as the step's cost goes: the
    KV cache counts that many entries written (their values stay what they are) and RoPE that
    many positions."""
    for state in talker.generator.states.states():
        if getattr(state, "kv_cache", None) is not None:
            state.kv_cache.end_offset[:] = frames
            state.offset[:] = frames


def attention_agreement(lm, frames: int) -> dict:
    """From one state per step, what the ring attention's eager step and moshi's sample
    (greedy, text and the agent's 8 codebooks: the user's 8 are forced, not sampled), over
    `frames` steps of one conversation on random user codes: each step is played with both attentions from the same snapshot, then the
    conversation goes on from moshi's. Agreement from one state, not of two free runs: with
    random weights one flipped near-tie sends two free runs apart for good."""
    from personaplex_triton import ring_attention
    from personaplex_triton.generation import NUM_AUDIO, SlotGenerator, StepInputs
    from personaplex_triton.sampling import SamplingParams

    generator = SlotGenerator(lm, 1, cuda_graphs=False, ring=True)
    samples = []
    model_step = generator._model_step
    generator._model_step = lambda *args: samples.append(model_step(*args)) or samples[-1]
    generator.start(0, SamplingParams(greedy=True))
    codes = torch.Generator().manual_seed(0)
    equal = total = 0
    differing_steps = []
    for step in range(frames):
        none = torch.zeros(1, dtype=torch.bool, device="cuda")
        inputs = StepInputs(torch.ones(1, dtype=torch.bool, device="cuda"),
                            torch.randint(0, 2048, (1, 8), generator=codes).cuda(),
                            torch.zeros(1, 8, dtype=torch.long, device="cuda"), none,
                            torch.zeros(1, dtype=torch.long, device="cuda"), none)
        snapshot = generator.snapshot(0)
        ring_attention.install(lm.transformer)
        generator.step(inputs)
        ring = samples[-1].clone()
        generator.restore(0, snapshot)
        ring_attention.uninstall(lm.transformer)
        generator.step(inputs)
        same = ring[:, :1 + NUM_AUDIO] == samples[-1][:, :1 + NUM_AUDIO]
        equal += int(same.sum())
        total += same.numel()
        if not bool(same.all()):
            differing_steps.append(step)
    generator.close()
    return {"frames": frames, "tokens_equal_pct": round(100 * equal / total, 2),
            "steps_with_a_difference": len(differing_steps), "first_differing_steps": differing_steps[:10]}


def new_persona_ms(talker, tokenizer) -> float:
    """How long slot 0 takes to start with a persona it has not seen: a voice bundle of 200
    frames (PersonaPlex ships about that) and a role prompt, all prefilled; median of 3."""
    from personaplex_triton.persona import Persona, VoicePrompt
    from personaplex_triton.sampling import SamplingParams
    from personaplex_triton.talker import TalkerSetup

    prompt = tuple(tokenizer.encode("You are a wise and friendly teacher. Answer questions or provide "
                                    "advice in a clear and engaging way."))
    times = []
    for i in range(3):
        voice = VoicePrompt(f"new-{i}", embeddings=0.02 * torch.randn(199, 1, 1, talker.lm.dim),
                            cache=talker.generator.grid.cache[0].cpu().clone())
        torch.cuda.synchronize()
        start = time.perf_counter()
        talker.start(0, TalkerSetup(Persona(voice, prompt), SamplingParams(seed=i)))
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 1)


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
    parser.add_argument("--attention", nargs="+", choices=["ring", "moshi"], default=["ring", "moshi"],
                        help="the step's attention: ring_attention.py, or moshi's (the reference)")
    parser.add_argument("--fill", type=int, nargs="+", default=[3000],
                        help="frames each conversation is into (its KV cache holds min(fill, 3000))")
    parser.add_argument("--agreement-frames", type=int, default=200,
                        help="steps whose greedy samples are compared between the attentions (0: none)")
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

    graphs = not args.no_cuda_graphs
    pool = max(args.slots)
    frames = {s: (0.1 * rng.standard_normal(1920)).astype(np.float32) for s in range(pool)}
    agreement = attention_agreement(lm, args.agreement_frames) if args.agreement_frames else None
    print("per-step agreement, ring vs moshi attention (eager):", agreement, flush=True)
    rows = []
    for attention in args.attention:
        talker = Talker(lm, TorchStepRunner("encoder", mimi, cuda_graphs=graphs), tokenizer, pool,
                        persona_cache_size=1, cuda_graphs=graphs, ring_attention=attention == "ring")
        if attention == "ring" and not talker.generator.ring_attention:
            raise SystemExit("ring attention is not available here (it needs CUDA and OpenAI Triton)")
        for s in range(pool):  # the first prefills the persona, the others start from the cache
            talker.start(s, TalkerSetup(Persona(voice, ()), SamplingParams(seed=s)))
        prefill_ms = new_persona_ms(talker, tokenizer)
        print(f"{attention} attention: a new persona's start (its prefill) {prefill_ms} ms", flush=True)
        for fill in args.fill:
            age(talker, fill)
            for slots in args.slots:  # the first `slots` slots tick: the step runs on their bucket
                batch = {s: frames[s] for s in range(slots)}
                torch.cuda.reset_peak_memory_stats()
                rows.append({"attention": attention, "context_frames": fill, "slots": slots,
                             "new_persona_start_ms": prefill_ms,
                             "talker_tick_ms": timed(lambda: talker.tick(batch), args.steps),
                             "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)})
                print(rows[-1], flush=True)
        talker.close()
        del talker
        gc.collect()  # the CUDA graphs' memory pools go with the last reference
        torch.cuda.empty_cache()
    code2wav = []
    for slots in args.slots:
        decoder = Code2Wav(TorchStepRunner("decoder", mimi, cuda_graphs=graphs), slots)
        codes = {s: rng.integers(0, 2048, 8) for s in range(slots)}
        for s in range(slots):
            decoder.start(s)
        code2wav.append({"slots": slots, "code2wav_tick_ms": timed(lambda: decoder.tick(codes), args.steps)})
        del decoder

    report = {"date": date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(),
              "lm_parameters": params, "dtype": "bfloat16", "cuda_graphs": not args.no_cuda_graphs,
              "build_s": round(build_s, 1), "steps": args.steps, "rows": rows, "code2wav": code2wav,
              "agreement": agreement}
    write_report(report, args.out, "gpu_step" if report["cuda_graphs"] else "gpu_step_eager")


def write_report(report, out: Path, name: str) -> None:
    rows, steps = report["rows"], report["steps"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    mode = "CUDA graphs" if report["cuda_graphs"] else "eager"
    tick = {(r["attention"], r["context_frames"], r["slots"]): r for r in rows}
    attentions = sorted({r["attention"] for r in rows}, reverse=True)  # ring first
    lines = [f"# GPU tick times ({report['date']}, {report['gpu']}, torch {report['torch']}, {mode})", "",
             f"PersonaPlex 7B architecture, {report['lm_parameters'] / 1e9:.2f} B parameters, random bf16 "
             f"weights; median of {steps} ticks (Talker.tick: Mimi encode, step, results on the host). "
             "Each conversation is `context frames` into its conversation (its KV cache holds "
             "min(that, 3000) entries). Command: `python bench/gpu_step.py --tokenizer ... --fill ...`.", "",
             "| context frames | live conversations | " + " | ".join(f"talker tick, {a} attention (ms)" for a in attentions)
             + (" | moshi / ring" if len(attentions) == 2 else "") + " | peak GPU memory (GiB) |",
             "| ---: | ---: | " + " | ".join("---:" for _ in attentions) + (" | ---:" if len(attentions) == 2 else "")
             + " | ---: |"]
    for fill, slots in sorted({(r["context_frames"], r["slots"]) for r in rows}):
        ms = [tick[(a, fill, slots)]["talker_tick_ms"] for a in attentions]
        ratio = [f"{ms[1] / ms[0]:.2f}"] if len(ms) == 2 else []
        peak = max(tick[(a, fill, slots)]["peak_gib"] for a in attentions)
        lines.append(f"| {fill} | {slots} | " + " | ".join(map(str, ms + ratio)) + f" | {peak} |")
    starts = sorted({(r["attention"], r.get("new_persona_start_ms")) for r in rows})
    lines += ["", "A new persona's start (its prefill: a 200-frame voice bundle and a 20-token role prompt, "
              "the pool idle): " + ", ".join(f"{ms} ms ({a} attention)" for a, ms in starts) + "."]
    lines += ["", "| live conversations | code2wav tick (ms) |", "| ---: | ---: |"]
    lines += [f"| {r['slots']} | {r['code2wav_tick_ms']} |" for r in report["code2wav"]]
    if report.get("agreement"):
        a = report["agreement"]
        lines += ["", f"Greedy samples (text + the agent's 8 codebooks) of the ring attention's eager step against moshi's, "
                  f"from the same state at each of {a['frames']} steps of one conversation: {a['tokens_equal_pct']}% "
                  f"equal; {a['steps_with_a_difference']} steps with a difference (first: "
                  f"{a['first_differing_steps']})."]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for attention in attentions:
        for fill in sorted({r["context_frames"] for r in rows}):
            mine = [r for r in rows if r["attention"] == attention and r["context_frames"] == fill]
            ax.plot([r["slots"] for r in mine], [r["talker_tick_ms"] for r in mine],
                    "o-" if attention == "ring" else "s--", label=f"talker, {attention} attention, {fill} frames in")
    ax.plot([r["slots"] for r in report["code2wav"]], [r["code2wav_tick_ms"] for r in report["code2wav"]],
            "^:", label="code2wav")
    slots = sorted({r["slots"] for r in rows})
    ax.axhline(80, color="grey", lw=0.8, label="real time (80 ms)")
    ax.set(xscale="log", xticks=slots, xticklabels=slots, xlabel="live conversations", ylabel="ms per tick")
    ax.legend(fontsize=7)
    ax.set_title(f"{report['gpu']}, {mode}, {report['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)


if __name__ == "__main__":
    with torch.no_grad():
        main()
