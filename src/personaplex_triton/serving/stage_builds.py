"""How each stage is built from its model's parameters: in the stub, or in a process of its own
(engine/stage_process.py), which calls these functions by name.

A build returns the stage and a `StageInfo`, what the model logs at load. What the stage
reports while it serves goes through `emit(name, *args)`, a call of the service's metrics of
that name: directly in the stub, through the pipe from a stage's process.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Callable

from ..core import loaders, tunables

Emit = Callable[..., None]


@dataclass(frozen=True)
class StageInfo:
    slots: int          # conversation slots
    slots_why: str      # how that number was chosen
    mimi: str           # the Mimi runtime, described (runtime.StepRunner.describe)
    mimi_runtime: str   # its name: tensorrt, onnxruntime or torch
    warmed: list[str] | None = None  # the talker's personas prefilled at load
    kv_dtype: str | None = None      # what the talker's KV cache stores


def stage_process(params: dict[str, str], device: str) -> bool:
    """A model's `stage_process` parameter: whether its stage runs in a process of its own;
    "auto": on a GPU (where it took the tick off the stub's GIL), not on a CPU (where two more
    processes on a few cores cost more than they save; docs/gpu-serving-log.md)."""
    value = params.get("stage_process", "auto").strip().lower()
    if value not in ("auto", "true", "false"):
        raise ValueError(f'parameter stage_process must be "auto", "true" or "false", got {value!r}')
    return device.startswith("cuda") if value == "auto" else value == "true"


def one_tick(params: dict[str, str]) -> bool:
    """The speech model's `one_tick` parameter: whether one engine's tick steps both stages
    (stages/speech.py) or each stage ticks in an engine of its own."""
    value = params.get("one_tick", "true").strip().lower()
    if value not in ("true", "false"):
        raise ValueError(f'parameter one_tick must be "true" or "false", got {value!r}')
    return value == "true"


def send_threads(params: dict[str, str], own_process: bool) -> int:
    """A model's `send_threads` parameter: the threads that send its answers (outbox lanes);
    "auto": tunables.STAGE_PROCESS_SEND_THREADS where the stage ticks in a process of its own
    (`own_process`), else 1 (the tick shares the stub's GIL with them; on a few CPU cores more
    lanes only contend)."""
    value = params.get("send_threads", "auto").strip().lower()
    if value == "auto":
        return tunables.STAGE_PROCESS_SEND_THREADS if own_process else 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f'parameter send_threads must be "auto" or a whole number of at least 1, got {value!r}')
    return int(value)


def talker_options(params: dict[str, str]) -> dict:
    """The talker's options of a model's parameters, as `TalkerService` takes them: the talker's
    and speech's models (model_configs.PARAMETERS) both serve one."""
    return dict(persona_cache_size=int(params["persona_cache_size"]), warm_personas=params.get("warm_personas", ""),
                dtype=params.get("dtype", "auto"), kv_dtype=params.get("kv_dtype", "auto"),
                min_tick_interval_ms=float(params.get("min_tick_interval_ms", "0")),
                start_piece_spacing=int(params.get("start_piece_spacing", tunables.PREFILL_CHUNK_SPACING_TICKS)))


def use_device_threads(device: str) -> None:
    """On a CPU, PyTorch's intra-op threads of this process (tunables.CPU_TORCH_THREADS: why).
    On a GPU, how long a thread that wants the GIL waits for another to give it up
    (tunables.GPU_GIL_SWITCH_S: why)."""
    import torch

    if device.startswith("cuda"):
        sys.setswitchinterval(tunables.GPU_GIL_SWITCH_S)
    else:
        torch.set_num_threads(tunables.CPU_TORCH_THREADS)


def pool_size(configured: int | str, device: str, cpu_default: int, on_gpu) -> tuple[int, str]:
    """A stage's conversation slots and why: the configured number; for "auto", `cpu_default`
    on a CPU and what `on_gpu()` returns ((slots, why)) on a GPU."""
    if str(configured) not in ("", "auto"):
        return int(configured), "configured"
    if device.startswith("cuda"):
        return on_gpu()
    return cpu_default, "auto: the default on a CPU"


def build_talker(checkpoint: str, max_conversations: int | str, device: str, persona_cache_size: int,
                 mimi_runtime: str, warm_personas: str, dtype: str, kv_dtype: str, emit: Emit,
                 decoder_in_process: bool = False):
    """The talker (stages/talker.Talker): the LM and Mimi's encoder on `device`, its pool, and
    the personas of `warm_personas` ("all", or voice names, comma-separated) prefilled into its
    cache, each with an empty role prompt, so that their first conversation starts at once;
    `decoder_in_process`: code2wav was built first in this process (talker.conversations_that_fit)."""
    import torch

    from ..lm import kv_cache
    from ..lm.sampling import SamplingParams
    from ..mimi.runtime import open_step
    from ..stages.persona import PersonaLibrary
    from ..stages.talker import Talker, TalkerSetup, conversations_that_fit

    use_device_threads(device)
    files = loaders.resolve_checkpoint(checkpoint)
    lm = loaders.get_lm(files, device, None if dtype in ("", "auto") else getattr(torch, dtype))
    kv = kv_cache.resolve(kv_dtype, device, next(lm.parameters()).dtype)
    mimi = open_step("encoder", files, mimi_runtime, device, threads=tunables.CPU_ENCODER_THREADS)
    tokenizer = loaders.get_tokenizer(files)
    slots, why = pool_size(max_conversations, device, tunables.CPU_TALKER_SLOTS,
                           lambda: conversations_that_fit(lm, mimi, kv, decoder_in_process))
    talker = Talker(lm, mimi, tokenizer, slots, persona_cache_size, kv_dtype=kv)
    names = files.voice_names() if warm_personas.strip() == "all" else \
        [name.strip() for name in warm_personas.split(",") if name.strip()]
    warmed = names[:talker.persona_cache.capacity]
    personas = PersonaLibrary(files, tokenizer, only=warmed)  # the requests' library is the service's
    for name in warmed:
        talker.prefill(0, TalkerSetup(personas.persona(name, ""), SamplingParams()))
        talker.stop(0)
    talker.persona_cache.on_lookup = lambda hit: emit("persona_cache_lookup", hit)  # after warming: clients' only
    return talker, StageInfo(slots, why, mimi.describe(), mimi.runtime, warmed, str(kv).removeprefix("torch."))


def build_code2wav(checkpoint: str, max_conversations: int | str, device: str, mimi_runtime: str, emit: Emit):
    """Code2wav (stages/code2wav.Code2Wav): Mimi's decoder on `device` and its pool; on a GPU
    its largest tick's memory taken at once (planned with the talker's pool:
    tunables.GPU_DECODER_RESERVED_BYTES)."""
    from ..mimi.runtime import open_step
    from ..stages.code2wav import Code2Wav

    use_device_threads(device)
    files = loaders.resolve_checkpoint(checkpoint)
    mimi = open_step("decoder", files, mimi_runtime, device)
    slots, why = pool_size(max_conversations, device, tunables.CPU_DECODER_SLOTS,
                           lambda: (tunables.GPU_DECODER_SLOTS, "auto: the default on a GPU"))
    decoder = Code2Wav(mimi, slots)
    if device.startswith("cuda"):
        decoder.take_largest_tick()
    return decoder, StageInfo(slots, why, mimi.describe(), mimi.runtime)


def build_speech(checkpoint: str, max_conversations: int | str, decoder_conversations: int | str, device: str,
                 persona_cache_size: int, mimi_runtime: str, warm_personas: str, dtype: str, kv_dtype: str,
                 emit: Emit):
    """Both stages as one (stages/speech.Speech), code2wav's built first: its largest tick's
    memory is taken before the talker sizes its pool, which then keeps none back for it; its info
    is the talker's and code2wav's StageInfo."""
    from ..stages.speech import Speech

    code2wav, code2wav_info = build_code2wav(checkpoint, decoder_conversations, device, mimi_runtime, emit)
    talker, talker_info = build_talker(checkpoint, max_conversations, device, persona_cache_size, mimi_runtime,
                                       warm_personas, dtype, kv_dtype, emit, decoder_in_process=True)
    stage = Speech(talker, code2wav)
    if stage.num_slots < talker_info.slots:
        talker_info = replace(talker_info, slots=stage.num_slots,
                              slots_why=f"{talker_info.slots_why}; code2wav has {code2wav_info.slots}")
    return stage, (talker_info, code2wav_info)


def open_stage(name: str, build: Callable, options: dict, own_process: bool, metrics):
    """(stage, StageInfo): `build(**options)` here, or in a process of its own, whose stage the
    engine drives through a pipe (engine/stage_process.py); what it emits goes to `metrics`."""
    from ..engine.stage_process import StageProcess

    def emit(event: str, *args) -> None:
        getattr(metrics, event)(*args)

    if not own_process:
        return build(**options, emit=emit)
    stage = StageProcess(name, build, options, on_event=emit)
    return stage, stage.info
