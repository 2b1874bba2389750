"""How each stage is built from its model's config (parameters.py): in the stub, or in a process of its own
(engine/stage_process.py), which calls these functions by name.

A build returns the stage and a `StageInfo`, what the model logs at load. What the stage
reports while it serves goes through `emit(name, *args)`, a call of the service's metrics of
that name: directly in the stub, through the pipe from a stage's process.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Callable

from ..core import gpu_waits, loaders, tunables
from .parameters import Code2WavConfig, SpeechConfig, StageConfig, TalkerConfig

Emit = Callable[..., None]


@dataclass(frozen=True)
class StageInfo:
    slots: int          # conversation slots
    slots_why: str      # how that number was chosen
    mimi: str           # the Mimi runtime, described (runtime.StepRunner.describe)
    mimi_runtime: str   # its name: tensorrt, onnxruntime or torch
    warmed: list[str] | None = None  # the talker's personas prefilled at load
    kv_dtype: str | None = None      # what the talker's KV cache stores


def use_device_threads(device: str) -> None:
    """PyTorch's intra-op threads of this process (tunables.TORCH_THREADS: why). On a GPU also
    how long a thread that wants the GIL waits for another to give it up (tunables.GPU_GIL_SWITCH_S:
    why), and threads that wait for the GPU sleep instead of spinning a core (core/gpu_waits.py)."""
    import torch

    torch.set_num_threads(tunables.TORCH_THREADS)
    if device.startswith("cuda"):
        sys.setswitchinterval(tunables.GPU_GIL_SWITCH_S)
        gpu_waits.sleep_while_gpu_works(device)


def pool_size(configured: int | None, device: str, cpu_default: int, on_gpu) -> tuple[int, str]:
    """A stage's conversation slots and why: the configured number; for auto (None),
    `cpu_default` on a CPU and what `on_gpu()` returns ((slots, why)) on a GPU."""
    if configured is not None:
        return configured, "configured"
    if device.startswith("cuda"):
        return on_gpu()
    return cpu_default, "auto: the default on a CPU"


def build_talker(config: TalkerConfig, emit: Emit, code2wav_in_process: bool = False):
    """The talker (stages/talker.Talker): the LM (its linears of `weight_dtype`) and Mimi's
    encoder on the config's device, its pool, and the personas of `warm_personas` (None: every
    voice) prefilled into its cache, each with an empty role prompt, so that their first
    conversation starts at once; `code2wav_in_process`: code2wav was built first in this process
    (talker.conversations_that_fit). On a GPU the memory budget is checked and taken before the
    LM loads (`take_budget`)."""
    import torch

    from ..lm import fp8_weights, kv_cache
    from ..lm.sampling import SamplingParams
    from ..mimi.runtime import open_step
    from ..stages.persona import PersonaLibrary
    from ..stages.talker import Talker, TalkerSetup, conversations_that_fit

    device = config.device
    weight_dtype = fp8_weights.resolve(config.weight_dtype, device)  # fp8 off CUDA: refused before any loading
    use_device_threads(device)
    files = loaders.resolve_checkpoint(config.checkpoint)
    mimi = open_step("encoder", files, config.mimi_runtime, device, threads=tunables.CPU_ENCODER_THREADS)
    budget = take_budget(config, files, weight_dtype, mimi, code2wav_in_process) if config.on_gpu else None
    lm = fp8_weights.load_lm(files, device, weight_dtype, None if config.dtype == "auto" else getattr(torch, config.dtype))
    kv = kv_cache.resolve(config.kv_dtype, device, lm.text_emb.weight.dtype)
    tokenizer = loaders.get_tokenizer(files)
    slots, why = pool_size(config.max_conversations, device, tunables.CPU_TALKER_SLOTS,
                           lambda: conversations_that_fit(lm, mimi, kv, code2wav_in_process, budget))
    talker = Talker(lm, mimi, tokenizer, slots, config.persona_cache_size, kv_dtype=kv)
    names = files.voice_names() if config.warm_personas is None else list(config.warm_personas)
    warmed = names[:talker.persona_cache.capacity]
    personas = PersonaLibrary(files, tokenizer, only=warmed)  # the requests' library is the service's
    for name in warmed:
        talker.prefill(0, TalkerSetup(personas.persona(name, ""), SamplingParams()))
        talker.stop(0)
    talker.persona_cache.on_lookup = lambda hit: emit("persona_cache_lookup", hit)  # after warming: clients' only
    return talker, StageInfo(slots, why, mimi.describe(), mimi.runtime, warmed, str(kv).removeprefix("torch."))


def take_budget(config: TalkerConfig, files, weight_dtype, encoder, code2wav_in_process: bool) -> int | None:
    """On a GPU, before the LM loads: `gpu_memory_gib` (auto: the whole card) checked against the
    talker's plan (`check_budget`, beside what this process holds already), then this process's
    allocator capped at it. Returns the budget's bytes, None for auto (the pool's sizing then
    counts the card's free memory)."""
    import torch

    from ..core import memory_budget

    budget = memory_budget.budget_bytes(config.gpu_memory_gib)
    card = torch.cuda.get_device_properties(config.device).total_memory
    check_budget(config, files, weight_dtype, encoder, budget or card, torch.cuda.memory_reserved(config.device),
                 code2wav_in_process)
    memory_budget.limit_process(budget, config.device)
    return budget


def check_budget(config: TalkerConfig, files, weight_dtype, encoder, budget: int, held: int,
                 code2wav_in_process: bool) -> int:
    """The conversations `budget` bytes hold by the talker's plan, weighed before loading (a meta
    LM, fp8_weights.planned_lm): the weights of `weight_dtype`, `held` (what this process's
    allocator holds already, e.g. code2wav's largest tick in one tick), what the pool's sizing
    keeps back (talker.kept_back_bytes) and each conversation (talker.conversation_bytes).
    MemoryBudgetError where that is none, saying what each part needs (and, with bf16 weights,
    to try fp8 ones)."""
    import torch

    from ..core import memory_budget
    from ..lm import fp8_weights, kv_cache
    from ..stages.talker import conversation_bytes, kept_back_bytes

    dtype = torch.bfloat16 if config.dtype == "auto" else getattr(torch, config.dtype)  # auto on a GPU: bf16
    planned = fp8_weights.planned_lm(files.lm_kwargs, weight_dtype, dtype)
    kv = kv_cache.resolve(config.kv_dtype, config.device, dtype)
    weights = "float8_e4m3fn linears" if weight_dtype == fp8_weights.FP8 else f"in {str(dtype).removeprefix('torch.')}"
    try:
        return memory_budget.check_plan(budget, fp8_weights.weight_bytes(planned),
                                        held + kept_back_bytes(planned, kv, code2wav_in_process),
                                        conversation_bytes(planned, encoder, kv), weights)
    except memory_budget.MemoryBudgetError as exc:
        auto = "" if config.gpu_memory_gib else " (gpu_memory_gib auto: the whole card)"
        hint = "" if weight_dtype == fp8_weights.FP8 else "; try weight_dtype float8_e4m3fn"
        raise memory_budget.MemoryBudgetError(f"{exc}{auto}{hint}") from None


def build_code2wav(config: Code2WavConfig, emit: Emit):
    """Code2wav (stages/code2wav.Code2Wav): Mimi's decoder on the config's device and its pool;
    on a GPU its largest tick's memory taken at once (planned with the talker's pool:
    tunables.GPU_DECODER_RESERVED_BYTES)."""
    from ..mimi.runtime import open_step
    from ..stages.code2wav import Code2Wav

    use_device_threads(config.device)
    files = loaders.resolve_checkpoint(config.checkpoint)
    mimi = open_step("decoder", files, config.mimi_runtime, config.device)
    slots, why = pool_size(config.max_conversations, config.device, tunables.CPU_DECODER_SLOTS,
                           lambda: (tunables.GPU_DECODER_SLOTS, "auto: the default on a GPU"))
    code2wav = Code2Wav(mimi, slots)
    if config.on_gpu:
        code2wav.take_largest_tick()
    return code2wav, StageInfo(slots, why, mimi.describe(), mimi.runtime)


def build_one_tick(config: SpeechConfig, emit: Emit):
    """Both stages as one (stages/one_tick.OneTickStage), code2wav's built first: its largest
    tick's memory is taken before the talker sizes its pool, which then keeps none back for it;
    its info is the talker's and code2wav's StageInfo."""
    from ..stages.one_tick import OneTickStage

    code2wav, code2wav_info = build_code2wav(config.code2wav(), emit)
    talker, talker_info = build_talker(config, emit, code2wav_in_process=True)
    stage = OneTickStage(talker, code2wav)
    if stage.num_slots < talker_info.slots:
        talker_info = replace(talker_info, slots=stage.num_slots,
                              slots_why=f"{talker_info.slots_why}; code2wav has {code2wav_info.slots}")
    return stage, (talker_info, code2wav_info)


def open_stage(name: str, build: Callable, config: StageConfig, metrics):
    """(stage, StageInfo): `build(config)` here, or (`config.stage_process`) in a process of its
    own, whose stage the engine drives through a pipe (engine/stage_process.py); what it emits
    goes to `metrics`."""
    from ..engine.stage_process import StageProcess

    def emit(event: str, *args) -> None:
        getattr(metrics, event)(*args)

    if not config.stage_process:
        return build(config=config, emit=emit)
    stage = StageProcess(name, build, {"config": config}, on_event=emit)
    return stage, stage.info
