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
    """On a CPU, PyTorch's intra-op threads of this process (tunables.CPU_TORCH_THREADS: why).
    On a GPU, how long a thread that wants the GIL waits for another to give it up
    (tunables.GPU_GIL_SWITCH_S: why), and threads that wait for the GPU sleep instead of
    spinning a core (core/gpu_waits.py)."""
    import torch

    if device.startswith("cuda"):
        sys.setswitchinterval(tunables.GPU_GIL_SWITCH_S)
        gpu_waits.sleep_while_gpu_works(device)
    else:
        torch.set_num_threads(tunables.CPU_TORCH_THREADS)


def pool_size(configured: int | None, device: str, cpu_default: int, on_gpu) -> tuple[int, str]:
    """A stage's conversation slots and why: the configured number; for auto (None),
    `cpu_default` on a CPU and what `on_gpu()` returns ((slots, why)) on a GPU."""
    if configured is not None:
        return configured, "configured"
    if device.startswith("cuda"):
        return on_gpu()
    return cpu_default, "auto: the default on a CPU"


def build_talker(config: TalkerConfig, emit: Emit, code2wav_in_process: bool = False):
    """The talker (stages/talker.Talker): the LM and Mimi's encoder on the config's device, its
    pool, and the personas of `warm_personas` (None: every voice) prefilled into its cache, each
    with an empty role prompt, so that their first conversation starts at once;
    `code2wav_in_process`: code2wav was built first in this process (talker.conversations_that_fit)."""
    import torch

    from ..lm import kv_cache
    from ..lm.sampling import SamplingParams
    from ..mimi.runtime import open_step
    from ..stages.persona import PersonaLibrary
    from ..stages.talker import Talker, TalkerSetup, conversations_that_fit

    device = config.device
    use_device_threads(device)
    files = loaders.resolve_checkpoint(config.checkpoint)
    lm = loaders.get_lm(files, device, None if config.dtype == "auto" else getattr(torch, config.dtype))
    kv = kv_cache.resolve(config.kv_dtype, device, next(lm.parameters()).dtype)
    mimi = open_step("encoder", files, config.mimi_runtime, device, threads=tunables.CPU_ENCODER_THREADS)
    tokenizer = loaders.get_tokenizer(files)
    slots, why = pool_size(config.max_conversations, device, tunables.CPU_TALKER_SLOTS,
                           lambda: conversations_that_fit(lm, mimi, kv, code2wav_in_process))
    talker = Talker(lm, mimi, tokenizer, slots, config.persona_cache_size, kv_dtype=kv)
    names = files.voice_names() if config.warm_personas is None else list(config.warm_personas)
    warmed = names[:talker.persona_cache.capacity]
    personas = PersonaLibrary(files, tokenizer, only=warmed)  # the requests' library is the service's
    for name in warmed:
        talker.prefill(0, TalkerSetup(personas.persona(name, ""), SamplingParams()))
        talker.stop(0)
    talker.persona_cache.on_lookup = lambda hit: emit("persona_cache_lookup", hit)  # after warming: clients' only
    return talker, StageInfo(slots, why, mimi.describe(), mimi.runtime, warmed, str(kv).removeprefix("torch."))


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
