"""Per-tick time of the two stages on a GPU, with PersonaPlex's 7B architecture (random bf16
weights) and a full-size Mimi, for several numbers of live conversations. The talker's model
step and both Mimi steps (PyTorch runtime) run under CUDA graphs (`--no-cuda-graphs`: eager,
the baseline).

    python bench/gpu_step.py --tokenizer TOKENIZER.model --slots 1 8 16 32 64 --fill 400 3000 --out bench/results
    python bench/gpu_step.py --tokenizer TOKENIZER.model --slots 1 8 32 64 128 --attention ring \
        --kv-dtype bfloat16 float8_e4m3fn                              (bf16 against fp8 KV)
    python bench/gpu_step.py --tokenizer TOKENIZER.model --slots 1 16 64 128 --kv-dtype bfloat16 float8_e4m3fn \
        --weight-dtype bfloat16 float8_e4m3fn                          (bf16 against fp8 weights, each KV)
    python bench/gpu_step.py --from-json bench/results/gpu_step-h200-838a005.json   (table and plot again)
    python bench/gpu_step.py --tokenizer TOKENIZER.model --device cpu --tiny --slots 1 2 --attention moshi \
        --steps 2 --agreement-frames 3 --out /tmp/smoke                   (a smoke test of the script on a CPU)

Writes gpu_step.{json,md,png} (gpu_step_eager.* with --no-cuda-graphs) under --out. A tick =
one temporal-transformer step, the depformer over the agent's 8 codebooks, sampling, results on
the host, and the Mimi encode of every slot's user frame (Talker.tick); code2wav = one batched
streaming Mimi decode (Code2Wav.tick). Each kernel set (ring: the project's kernels; moshi's
modules), weight dtype (bf16, then the same weights quantized to fp8: fp8_weights.py) and KV
cache dtype (kv_cache.py) at each context fill; per weight and KV dtype, the bytes of the
weights and of a conversation, how many fit beside the weights on this card (a pool of more
than `max_conversations auto` gives is not run) and under each budget of BUDGETS_GIB by the
server's plan (core/memory_budget.py); the greedy samples of the project's kernels against
moshi's modules, of moshi's modules alone against the same in a batch of 8 (bf16's own floor),
of fp8 against bf16 KV and of fp8 against bf16 weights, from the same states (`agreement`);
with --anchor, moshi's own step of the same session beside the ticks.
"""

import argparse
import copy
import gc
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

BUDGETS_GIB = (16, 24, 48, 80, 141)  # gpu_memory_gib: the cards a budget stands in for


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work (a CPU's is done when it returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def age(generator, frames: int) -> None:
    """Put every slot of a SlotGenerator `frames` frames into its conversation, as far as the
    step's cost goes: the KV cache counts that many entries written (their values stay what they
    are) and RoPE that many positions."""
    for state in generator.states.states():
        if getattr(state, "kv_cache", None) is not None:
            state.kv_cache.end_offset[:] = frames
            state.offset[:] = frames


def agreement(lm, frames: int, reference: dict, candidate: dict, candidate_rows: int = 1, candidate_lm=None) -> dict:
    """From one state per step, what two generators on `lm`'s weights sample (eager, greedy,
    text and the agent's 8 codebooks, the user's 8 being forced; `reference` and `candidate`:
    their SlotGenerator options), over `frames` steps of one conversation on random user
    codes: each step is played by both from the reference's state, then the conversation goes
    on from the reference's. Agreement from one state, not of two free runs: with random
    weights one flipped near-tie sends two free runs apart for good. The candidate steps
    `candidate_rows` rows, the conversation in the first and others on their own random codes
    beside it: a batch's shape may change which kernels a GPU runs, and so the sums' order.
    `candidate_lm`: the candidate's model (fp8 weights, say; None: `lm`'s weights)."""
    from personaplex_triton.lm.generation import SlotGenerator, StepInputs
    from personaplex_triton.lm.sampling import SamplingParams
    from personaplex_triton.lm.token_grid import NUM_AUDIO

    twin = candidate_lm or copy.deepcopy(lm, memo={id(t): t for t in (*lm.parameters(), *lm.buffers())})  # own state
    generators = [SlotGenerator(model, rows, cuda_graphs=False, **options)
                  for model, options, rows in ((lm, reference, 1), (twin, candidate, candidate_rows))]
    samples = [None, None]
    for i, generator in enumerate(generators):
        def recorded(*args, i=i, model_step=generator.model_step):
            samples[i] = model_step(*args)
            return samples[i]
        generator.model_step = recorded
        for slot in range(generator.num_slots):
            generator.start(slot, SamplingParams(greedy=True))
    device = lm.device
    codes = torch.Generator().manual_seed(0)
    equal = total = 0
    differing_steps = []
    for step in range(frames):
        user = torch.randint(0, 2048, (candidate_rows, 8), generator=codes)
        generators[1].restore([0], generators[0].snapshot(0))
        for generator in generators:
            b = generator.num_slots
            none = torch.zeros(b, dtype=torch.bool, device=device)
            generator.step(StepInputs(torch.ones(b, dtype=torch.bool, device=device), user[:b].to(device),
                                      torch.zeros(b, 8, dtype=torch.long, device=device), none,
                                      torch.zeros(b, dtype=torch.long, device=device), none))
        same = samples[0][:1, :1 + NUM_AUDIO] == samples[1][:1, :1 + NUM_AUDIO]
        equal += int(same.sum())
        total += same.numel()
        if not bool(same.all()):
            differing_steps.append(step)
    for generator in generators:
        generator.close()
    return {"frames": frames, "candidate_rows": candidate_rows, "tokens_equal_pct": round(100 * equal / total, 2),
            "steps_with_a_difference": len(differing_steps), "first_differing_steps": differing_steps[:10]}


def new_persona_ms(talker, tokenizer) -> float:
    """How long slot 0 takes to start with a persona it has not seen: a voice bundle of 200
    frames (PersonaPlex ships about that) and a role prompt, all prefilled; median of 3."""
    from personaplex_triton.lm.sampling import SamplingParams
    from personaplex_triton.stages.persona import Persona, VoicePrompt
    from personaplex_triton.stages.talker import TalkerSetup

    prompt = tuple(tokenizer.encode("You are a wise and friendly teacher. Answer questions or provide "
                                    "advice in a clear and engaging way."))
    times = []
    for i in range(3):
        voice = VoicePrompt(f"new-{i}", embeddings=0.02 * torch.randn(199, 1, 1, talker.lm.dim),
                            cache=talker.generator.grid.cache[0].cpu().clone())
        synchronize(talker.lm.device)
        start = time.perf_counter()
        talker.prefill(0, TalkerSetup(Persona(voice, prompt), SamplingParams(seed=i)))
        synchronize(talker.lm.device)
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 1)


def timed(fn, steps: int, device: torch.device) -> float:
    """Median ms of `steps` calls of `fn` on `device`, after 3 (CUDA-graph capture and warm-up)."""
    for _ in range(3):
        fn()
    synchronize(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 2)


class CallCounter(TorchFunctionMode):
    """Counts the PyTorch functions and tensor methods called from Python (each lets go of the GIL)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def calls_a_tick(tick) -> int:
    """The PyTorch calls `tick()` makes from Python: each lets a Triton stub's other threads take the GIL."""
    counter = CallCounter()
    with counter:
        tick()
    return counter.calls


def main(argv=None):
    from moshi.models import loaders as moshi_loaders
    import sentencepiece

    from personaplex_triton.core import loaders
    from personaplex_triton.lm import fp8_weights, kv_cache
    from personaplex_triton.mimi.runtime import TorchStepRunner
    from personaplex_triton.stages.code2wav import Code2Wav, CodesFrame
    from personaplex_triton.stages.persona import VoicePrompt
    from personaplex_triton.stages.talker import conversation_bytes, conversations_that_fit, kept_back_bytes

    args = parse_args(argv)
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        if args.anchor:
            report["anchor"] = read_anchor(args.anchor)
        return write_report(report, args.out, args.from_json.stem)

    torch.manual_seed(0)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    started = time.perf_counter()
    size = loaders.TINY_LM_SIZE if args.tiny else {}
    lm = moshi_loaders.get_moshi_lm(None, lm_kwargs={**loaders.PERSONAPLEX_LM_KWARGS, **size}, device=device,
                                    dtype=torch.bfloat16)
    lm.eval()
    params = sum(p.numel() for p in lm.parameters())
    mimi = moshi_loaders.get_mimi(None, device=device)
    tokenizer = sentencepiece.SentencePieceProcessor(str(args.tokenizer))
    build_s = time.perf_counter() - started
    rng = np.random.default_rng(0)
    voice = VoicePrompt("noise", frames=(0.1 * rng.standard_normal((2, 1920))).astype(np.float32))

    graphs = gpu and not args.no_cuda_graphs
    frames = {s: (0.1 * rng.standard_normal(1920)).astype(np.float32) for s in range(max(args.slots))}
    agreements = {}
    if args.agreement_frames and gpu:
        agreements["attention"] = agreement(lm, args.agreement_frames, {"ring": False}, {"ring": True})
        print("per-step agreement, the project's kernels vs moshi's modules (eager):", agreements["attention"],
              flush=True)
    if args.agreement_frames:
        # bf16's own floor: moshi's modules against themselves, the conversation alone and in a batch of 8
        agreements["batch"] = agreement(lm, args.agreement_frames, {"ring": False}, {"ring": False}, candidate_rows=8)
        print("per-step agreement, moshi's modules alone vs in a batch of 8 (eager):", agreements["batch"], flush=True)
    if args.agreement_frames and set(args.kv_dtype) == set(kv_cache.KV_DTYPES):
        agreements["kv"] = agreement(lm, args.agreement_frames, {"kv_dtype": torch.bfloat16},
                                     {"kv_dtype": torch.float8_e4m3fn})
        print("per-step agreement, fp8 vs bf16 KV (eager):", agreements["kv"], flush=True)
    if args.agreement_frames and set(args.weight_dtype) == set(fp8_weights.WEIGHT_DTYPES):
        agreements["weights"] = agreement(lm, args.agreement_frames, {}, {}, candidate_lm=quantized_twin(lm))
        print("per-step agreement, fp8 vs bf16 weights (eager):", agreements["weights"], flush=True)
    release_memory(device)  # the agreements' pools and twin: free memory is measured next
    rows, memory = [], {}
    for weight_name in args.weight_dtype:  # bf16 first: quantizing the LM in place is for good
        if weight_name == "float8_e4m3fn":
            fp8_weights.quantize_linears(lm)
            release_memory(device)  # the bf16 linears
        weights = fp8_weights.weight_bytes(lm)
        for kv_name in args.kv_dtype:
            kv_dtype = kv_cache.KV_DTYPES[kv_name]
            encoder = TorchStepRunner("encoder", mimi, cuda_graphs=graphs)
            each = conversation_bytes(lm, encoder, kv_dtype)
            entry = {"weight_bytes": weights, "kv_bytes_per_conversation":
                     kv_cache.bytes_per_conversation(lm.transformer, kv_dtype), "bytes_per_conversation": each,
                     "fit_per_budget": fit_per_budget(weights, each, kept_back_bytes(lm, kv_dtype))}
            if gpu:
                free, _ = torch.cuda.mem_get_info()  # the weights loaded, no pool yet: as serving sizes its pool
                auto, why = conversations_that_fit(lm, encoder, kv_dtype)
                entry |= {"free_gib_after_weights": round(free / 2**30, 1), "conversations_that_fit": free // each,
                          "max_conversations_auto": auto}
            else:
                auto, why = max(args.slots), "a CPU: every pool asked for"
            memory[f"{weight_name} weights, {kv_name} KV"] = entry
            print(f"{weight_name} weights, {kv_name} KV: {entry} ({why})", flush=True)
            pool = max([s for s in args.slots if s <= auto], default=0)  # a larger one would not fit
            rows += [{"attention": a, "weight_dtype": weight_name, "kv_dtype": kv_name, "context_frames": fill,
                      "slots": slots, "talker_tick_ms": None, "peak_gib": None}
                     for a in args.attention for fill in args.fill for slots in args.slots if slots > pool]
            for attention in args.attention if pool else ():
                encoder = TorchStepRunner("encoder", mimi, cuda_graphs=graphs)
                rows += [{**row, "weight_dtype": weight_name} for row in
                         talker_ticks(lm, encoder, tokenizer, pool, attention, kv_dtype, voice, frames, args)]
    code2wav = []
    for slots in args.slots:
        release_memory(device)
        base = torch.cuda.memory_allocated() if gpu else 0
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        decoder = Code2Wav(TorchStepRunner("decoder", mimi, cuda_graphs=graphs), slots)
        codes = {s: CodesFrame(rng.integers(0, 2048, 8)) for s in range(slots)}
        for s in range(slots):
            decoder.prefill(s)
        code2wav.append({"slots": slots, "code2wav_tick_ms": timed(lambda: decoder.tick(codes), args.steps, device),
                         # what a decoder of this many slots needs beyond Mimi's weights: its pool and a full tick
                         "code2wav_peak_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
                         if gpu else None})
        print(code2wav[-1], flush=True)
        del decoder

    report = {"date": date.today().isoformat(), "gpu": torch.cuda.get_device_name() if gpu else "CPU",
              "command": "python bench/gpu_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "torch": torch.__version__, "python": platform.python_version(),
              "lm_parameters": params, "dtype": "bfloat16", "cuda_graphs": graphs,
              "build_s": round(build_s, 1), "steps": args.steps, "rows": rows, "code2wav": code2wav,
              "memory": memory, "agreement": agreements.get("attention"), "batch_agreement": agreements.get("batch"),
              "kv_agreement": agreements.get("kv"), "weight_agreement": agreements.get("weights"),
              "anchor": read_anchor(args.anchor) if args.anchor else None}
    write_report(report, args.out, "gpu_step" if report["cuda_graphs"] or not gpu else "gpu_step_eager")


def quantized_twin(lm):
    """A copy of `lm` with fp8 linear layers (fp8_weights.py) sharing its other weights."""
    from personaplex_triton.lm import fp8_weights

    twin = copy.deepcopy(lm, memo={id(t): t for t in (*lm.parameters(), *lm.buffers())})
    fp8_weights.quantize_linears(twin)
    return twin


def fit_per_budget(weights: int, each: int, kept_back: int) -> dict[str, int]:
    """Conversations of `each` bytes that each budget of BUDGETS_GIB holds beside `weights` and
    what the server's plan keeps back beside the pool (`kept_back`: talker.kept_back_bytes, with
    code2wav in a process of its own); 0 where the plan refuses to start."""
    from personaplex_triton.core import memory_budget

    fits = {}
    for gib in BUDGETS_GIB:
        try:
            fits[str(gib)] = memory_budget.check_plan(gib * memory_budget.GIB, weights, kept_back, each, "")
        except memory_budget.MemoryBudgetError:
            fits[str(gib)] = 0
    return fits


def release_memory(device: torch.device) -> None:
    """Garbage (a graph's pool, a twin model) collected and, on a GPU, the allocator's cache
    given back, so that the free memory read next counts it."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def talker_ticks(lm, encoder, tokenizer, pool: int, attention: str, kv_dtype, voice, frames, args) -> list[dict]:
    """A talker of `pool` slots: a new persona's start, then the tick of the first `slots` slots
    (the step runs on their bucket) at each fill and slot count up to the pool."""
    from personaplex_triton.lm.sampling import SamplingParams
    from personaplex_triton.stages.persona import Persona
    from personaplex_triton.stages.talker import Talker, TalkerSetup

    device = lm.device
    gpu = device.type == "cuda"
    graphs = gpu and not args.no_cuda_graphs
    talker = Talker(lm, encoder, tokenizer, pool, persona_cache_size=1, cuda_graphs=graphs,
                    ring_attention=attention == "ring", kv_dtype=kv_dtype)
    if attention == "ring" and not talker.generator.ring_attention:
        raise SystemExit("ring attention is not available here (it needs CUDA and OpenAI Triton)")
    kv_name = str(kv_dtype).removeprefix("torch.")
    for s in range(pool):  # the first prefills the persona, the others start from the cache
        talker.prefill(s, TalkerSetup(Persona(voice, ()), SamplingParams(seed=s)))
    prefill_ms = new_persona_ms(talker, tokenizer)
    print(f"{attention} attention, {kv_name} KV: a new persona's start (its prefill) {prefill_ms} ms", flush=True)
    rows = []
    for fill in args.fill:
        age(talker.generator, fill)
        for slots in (s for s in args.slots if s <= pool):
            batch = {s: frames[s] for s in range(slots)}
            if gpu:
                torch.cuda.reset_peak_memory_stats()
            rows.append({"attention": attention, "kv_dtype": kv_name, "context_frames": fill, "slots": slots,
                         "new_persona_start_ms": prefill_ms,
                         "talker_tick_ms": timed(lambda: talker.tick(batch), args.steps, device),
                         "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if gpu else None})
            print(rows[-1], flush=True)
    talker.close()
    del talker
    release_memory(device)  # the CUDA graphs' memory pools go with the last reference
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    from personaplex_triton.lm import fp8_weights, kv_cache

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tokenizer", type=Path, help="a SentencePiece model (any)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--from-json", type=Path, help="only render the table and plot of a result")
    parser.add_argument("--anchor", type=Path, help="moshi's LMGen steps of the same session "
                        "(bench/moshi_anchor.py's JSON): a column beside the ticks")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="eager model and Mimi steps")
    parser.add_argument("--attention", nargs="+", choices=["ring", "moshi"], default=["ring"],
                        help="the step's kernels: ring = ring_attention.py and fused_ops.py, moshi = moshi's "
                             "modules (the reference)")
    parser.add_argument("--kv-dtype", nargs="+", choices=list(kv_cache.KV_DTYPES), default=["bfloat16"],
                        help="what the KV cache stores (kv_cache.py)")
    parser.add_argument("--weight-dtype", nargs="+", choices=list(fp8_weights.WEIGHT_DTYPES), default=["bfloat16"],
                        help="the transformers' linear weights (fp8_weights.py: float8_e4m3fn quantized from the "
                             "bf16 ones)")
    parser.add_argument("--fill", type=int, nargs="+", default=[3000],
                        help="frames each conversation is into (its KV cache holds min(fill, 3000))")
    parser.add_argument("--agreement-frames", type=int, default=200,
                        help="steps whose greedy samples are compared: the project's kernels against moshi's "
                             "modules, bf16's floor, and fp8 against bf16 KV and weights where both run (0: none)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (no memory figures)")
    parser.add_argument("--tiny", action="store_true",
                        help="the generated development checkpoint's widths (loaders.TINY_LM_SIZE), for a smoke test")
    args = parser.parse_args(argv)
    if args.tokenizer is None and args.from_json is None:
        parser.error("--tokenizer is required for a run")
    # quantizing the LM in place is for good: its bf16 weights run first
    args.weight_dtype = sorted(set(args.weight_dtype), key=list(fp8_weights.WEIGHT_DTYPES).index)
    return args


def read_anchor(path: Path) -> dict:
    """moshi's LMGen step (bench/moshi_anchor.py's JSON), measured in the same session: ms by batch."""
    return {str(r["batch"]): r["step_ms"] for r in json.loads(path.read_text())["rows"]}


def run_of(row: dict) -> tuple[str, str, str]:
    """A row's run: (attention, weight dtype, KV dtype); results from before a dtype was an
    option have none: bf16."""
    return row["attention"], row.get("weight_dtype", "bfloat16"), row.get("kv_dtype", "bfloat16")


def write_report(report, out: Path, name: str) -> None:
    rows, steps = report["rows"], report["steps"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    mode = "CUDA graphs" if report["cuda_graphs"] else "eager"
    tick = {(*run_of(r), r["context_frames"], r["slots"]): r for r in rows}
    weight_order = ("bfloat16", "float8_e4m3fn")
    runs = sorted({key[:3] for key in tick}, key=lambda run: (run[0] != "ring", weight_order.index(run[1]), run[2]))
    varying = [i for i in range(3) if len({run[i] for run in runs}) > 1]
    suffix = ("", " weights", " KV") if len(varying) > 1 else ("", "", "")
    label = {run: f"{run[0]} attention" + "".join(f", {run[i]}{(' weights', ' KV')[i - 1]}" for i in varying if i)
             for run in runs}
    short = {run: ", ".join(f"{run[i]}{suffix[i]}" for i in varying) or run[0] for run in runs}
    # each fp8-weight run against its bf16-weight twin; else two runs, the second against the first
    pairs = [((run[0], "bfloat16", run[2]), run) for run in runs
             if run[1] == "float8_e4m3fn" and (run[0], "bfloat16", run[2]) in runs]
    if not pairs and len(runs) == 2:
        pairs = [tuple(runs)]
    anchor = report.get("anchor")
    lines = [f"# GPU tick times ({report['date']}, {report['gpu']}, torch {report['torch']}, {mode})", "",
             f"PersonaPlex's architecture, {report['lm_parameters'] / 1e9:.2f} B parameters, random bf16 "
             f"weights; median of {steps} ticks (Talker.tick: Mimi encode, step, results on the host). "
             "Each conversation is `context frames` into its conversation (its KV cache holds "
             "min(that, 3000) entries); - where that many conversations do not fit beside the weights. "
             f"Command: `{report.get('command', 'python bench/gpu_step.py --tokenizer ... --fill ...')}`.", "",
             "| context frames | live conversations | " + " | ".join(f"talker tick, {label[run]} (ms)" for run in runs)
             + "".join(f" | {short[run]} / {short[base]}" for base, run in pairs)
             + (" | moshi `LMGen.step` (ms) | tick / moshi (" + ", ".join(short[run] for run in runs) + ")"
                if anchor else "")
             + f" | peak GPU memory (GiB{', ' + ' / '.join(short[run] for run in runs) if len(runs) > 1 else ''}) |",
             "| ---: | ---: | " + " | ".join("---:" for _ in runs) + " | ---:" * len(pairs)
             + (" | ---: | ---:" if anchor else "") + " | ---: |"]
    for fill, slots in sorted({key[3:] for key in tick}):
        ms = [tick.get((*run, fill, slots), {}).get("talker_tick_ms") for run in runs]
        peaks = [tick.get((*run, fill, slots), {}).get("peak_gib") for run in runs]
        cells = [str(m) if m is not None else "-" for m in ms]
        for base, run in pairs:
            a, b = (tick.get((*r, fill, slots), {}).get("talker_tick_ms") for r in (base, run))
            cells.append(f"{b / a:.2f}" if a is not None and b is not None else "-")
        if anchor:
            moshi = anchor.get(str(slots))
            cells += [str(moshi) if moshi else "-",
                      " / ".join(f"{m / moshi:.2f}" if m and moshi else "-" for m in ms)]
        lines.append(f"| {fill} | {slots} | " + " | ".join(cells) + " | "
                     + " / ".join(str(p) if p is not None else "-" for p in peaks) + " |")
    starts = sorted({(label[run_of(r)], r["new_persona_start_ms"])
                     for r in rows if r.get("new_persona_start_ms") is not None})
    lines += ["", "A new persona's start (its prefill: a 200-frame voice bundle and a 20-token role prompt, "
              "the pool idle): " + ", ".join(f"{ms} ms ({run})" for run, ms in starts) + "."]
    if report.get("memory"):
        lines += ["", "| weights, KV cache | weights (GiB) | KV per conversation (GiB) | with Mimi's state (GiB) "
                  "| free after the weights (GiB) | conversations that fit (free / per conversation) "
                  "| `max_conversations auto` | " + " | ".join(f"under {gib} GiB" for gib in BUDGETS_GIB) + " |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in BUDGETS_GIB) + " |"]
        for what, m in report["memory"].items():
            weights = f"{m['weight_bytes'] / 2**30:.2f}" if "weight_bytes" in m else "-"
            fits = [m.get("fit_per_budget", {}).get(str(gib), "-") for gib in BUDGETS_GIB]
            lines.append(f"| {what} | {weights} | {m['kv_bytes_per_conversation'] / 2**30:.2f} "
                         f"| {m['bytes_per_conversation'] / 2**30:.2f} | {m.get('free_gib_after_weights', '-')} "
                         f"| {m.get('conversations_that_fit', '-')} | {m.get('max_conversations_auto', '-')} | "
                         + " | ".join(str(f) for f in fits) + " |")
        if any("fit_per_budget" in m for m in report["memory"].values()):
            lines += ["", "Under a budget (`gpu_memory_gib`), conversations that fit by the server's plan: the budget "
                      "less the weights, the memory kept back beside the pool (8 GiB for graphs, persona cache and "
                      "prefill; 6 GiB for code2wav's largest tick) and a prefill's KV cache; 0: the server refuses "
                      "to start."]
    lines += ["", "| live conversations | code2wav tick (ms) | code2wav memory (GiB) |", "| ---: | ---: | ---: |"]
    lines += [f"| {r['slots']} | {r['code2wav_tick_ms']} | {r.get('code2wav_peak_gib', '')} |" for r in report["code2wav"]]
    for key, what in (("agreement", "the eager step on the project's kernels (ring attention, fused RoPE, norms and "
                                    "gatings) against moshi's modules"),
                      ("batch_agreement", "moshi's modules on the conversation alone against the same in a batch of "
                                          "8 (bf16's floor: the same code, only the batch's shape differs)"),
                      ("kv_agreement", "the eager step with an fp8 KV cache against a bf16 one"),
                      ("weight_agreement", "the eager step with fp8 weights (fp8_weights.py) against the bf16 ones "
                                           "they were quantized from")):
        if report.get(key):
            a = report[key]
            lines += ["", f"Greedy samples (text + the agent's 8 codebooks) of {what}, from the same state at each of "
                      f"{a['frames']} steps of one conversation: {a['tokens_equal_pct']}% equal; "
                      f"{a['steps_with_a_difference']} steps with a difference (first: {a['first_differing_steps']})."]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for run in runs:
        for fill in sorted({r["context_frames"] for r in rows}):
            mine = [r for key, r in sorted(tick.items(), key=lambda item: item[0][4])
                    if key[:4] == (*run, fill) and r["talker_tick_ms"] is not None]
            ax.plot([r["slots"] for r in mine], [r["talker_tick_ms"] for r in mine],
                    "o-" if run[0] == "ring" else "s--", label=f"talker, {label[run]}, {fill} frames in")
    ax.plot([r["slots"] for r in report["code2wav"]], [r["code2wav_tick_ms"] for r in report["code2wav"]],
            "^:", label="code2wav")
    if anchor:
        batches = sorted(anchor, key=int)
        ax.plot([int(b) for b in batches], [anchor[b] for b in batches], "kx--", label="moshi LMGen.step")
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
