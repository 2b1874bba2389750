"""Each served model's parameters, in one place: a frozen dataclass per model (`TalkerConfig`,
`Code2WavConfig`, `SpeechConfig` for the one-stub model `speech`) whose fields are the
parameters, each with its default (as written in `config.pbtxt`), its check and its help.

A model's `initialize` reads them once (`from_triton`); `config.pbtxt` files (model_configs.py)
and the table in docs/configuration.md are generated from the same fields. Adding a parameter
is one field here, then `make configs` (and the docs table: model_configs.py --docs).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields, replace
from typing import Callable

from ..core import loaders, tunables


class ParameterError(ValueError):
    """A model parameter's value fails its check; the message names the model and parameter."""


def parameter(default: str, parse: Callable[[str], object], help: str):
    """A config field: its value is `parse(text)` of a parameter's text (ValueError saying what
    is wrong), its default `parse(default)`; `help` is written above it in config.pbtxt."""
    return field(default=parse(default), metadata={"text": default, "parse": parse, "help": help})


def auto_or(parse: Callable[[str], object]) -> Callable[[str], object]:
    """"auto" (or empty) -> None, chosen when the instance's device is known (`resolved`)."""
    return lambda text: None if text.strip().lower() in ("", "auto") else parse(text)


def whole(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not text.strip().isdigit() or int(text) < least:
            raise ValueError(f"a whole number of at least {least}")
        return int(text)
    return parse


def positive(unit: str) -> Callable[[str], float]:
    """A number of `unit` (seconds, GiB), more than 0."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"a number of {unit}") from None
        if not value > 0:
            raise ValueError(f"more than 0 {unit}")
        return value
    return parse


positive_seconds = positive("seconds")


def one_of(*words: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        word = text.strip().lower() or words[0]
        if word not in words:
            raise ValueError(" or ".join(f'"{w}"' for w in words))
        return word
    return parse


def boolean(text: str) -> bool:
    return one_of("true", "false")(text) == "true"


def text_as_is(text: str) -> str:
    return text.strip()


def device_name(text: str) -> str:
    word = text.strip().lower() or "auto"
    if word not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", word):
        raise ValueError('"auto", "cpu", "cuda" or "cuda:N"')
    return word


def voice_names(text: str) -> tuple[str, ...] | None:
    """"all" -> None (every voice of the checkpoint); else the names, comma-separated."""
    if text.strip().lower() == "all":
        return None
    return tuple(name.strip() for name in text.split(",") if name.strip())


IDLE_TIMEOUT_S = "60"  # both stages' (the talker's help says more of it)


@dataclass(frozen=True)
class StageConfig:
    """The parameters both stages have. `device`, `stage_process` and `send_threads` may be
    auto (None for the latter two) until `resolved` picks them for the instance."""

    max_conversations: int | None = parameter("auto", auto_or(whole(1)), "Conversation slots of one instance.")
    checkpoint: str = parameter("", text_as_is, '"" serves $PERSONAPLEX_CHECKPOINT, else the generated '
                                                "checkpoints/tiny of this repository.")
    device: str = parameter("auto", device_name, "auto: the instance's GPU where there is one, else the CPU.")
    mimi_runtime: str = parameter(
        "auto", one_of("auto", "tensorrt", "onnxruntime", "torch"),
        "Where Mimi runs: auto (TensorRT engine, else ONNX Runtime on the CPU, else PyTorch; the server log "
        "says which), or forced: tensorrt, onnxruntime, torch.")
    idle_timeout_s: float = parameter(IDLE_TIMEOUT_S, positive_seconds,
                                      "A conversation with nothing pending this long is closed.")
    send_threads: int | None = parameter(
        "auto", auto_or(whole(1)),
        "Threads that send a tick's answers, each its own conversations' in order: a send is a round trip to "
        "tritonserver, and several can be in flight at once; auto: 4 where the stage runs in a process of its "
        "own (stage_process), else 1.")
    stage_process: bool | None = parameter(
        "auto", auto_or(boolean),
        "true: the stage (its model and its ticks) runs in a process of its own beside the stub, so that its "
        "ticks never wait for the stub's GIL (its request and send threads); auto: on a GPU, not on a CPU.")

    @classmethod
    def model(cls) -> str:
        return MODEL_NAMES[cls]

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]):
        """The config of a model's parameters (key -> text), each checked; ParameterError names
        the first that fails, or one the model does not have. Those left out keep their default."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(parameters) - set(known))
        if unknown:
            raise ParameterError(f"{cls.model()}: no such parameter: {', '.join(unknown)} "
                                 f"(it has: {', '.join(known)})")
        values = {}
        for key, text in parameters.items():
            try:
                values[key] = known[key].metadata["parse"](text)
            except ValueError as exc:
                raise ParameterError(f"{cls.model()}: parameter {key} must be {exc}; got {text!r}") from None
        return cls(**values)

    @classmethod
    def from_triton(cls, args: dict):
        """The config of a model instance's `initialize(args)`: its config.pbtxt parameters,
        resolved for the instance's device (a KIND_GPU instance's GPU)."""
        config = json.loads(args["model_config"])
        parameters = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        gpu = int(args["model_instance_device_id"]) if args.get("model_instance_kind") == "GPU" else None
        return cls.from_parameters(parameters).resolved(gpu)

    def resolved(self, gpu_index: int | None = None):
        """The config with nothing left to choose: the checkpoint (loaders.checkpoint_spec); the
        device (the instance's GPU `gpu_index`, any CUDA device, else the CPU); `stage_process`
        auto on a GPU only (on a few CPU cores two more processes cost more than they save);
        `send_threads` auto: tunables.STAGE_PROCESS_SEND_THREADS in a process of its own, else 1
        (beside the tick in the stub, more threads only contend for its GIL)."""
        device = self.device
        if device in ("", "auto"):
            import torch

            device = "cpu" if not torch.cuda.is_available() else "cuda" if gpu_index is None else f"cuda:{gpu_index}"
        own_process = device.startswith("cuda") if self.stage_process is None else self.stage_process
        threads = self.send_threads or (tunables.STAGE_PROCESS_SEND_THREADS if own_process else 1)
        return replace(self, checkpoint=loaders.checkpoint_spec(self.checkpoint), device=device,
                       stage_process=own_process, send_threads=threads)

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")


@dataclass(frozen=True)
class Code2WavConfig(StageConfig):
    max_conversations: int | None = parameter(
        "auto", auto_or(whole(1)),
        "More than the talker's: a conversation that ends without FINAL holds its slot until replaced. auto: "
        f"{tunables.CPU_DECODER_SLOTS} on a CPU, {tunables.GPU_DECODER_SLOTS} on a GPU.")


@dataclass(frozen=True)
class TalkerConfig(StageConfig):
    max_conversations: int | None = parameter(
        "auto", auto_or(whole(1)),
        f"Conversation slots of one instance: a number, or auto: {tunables.CPU_TALKER_SLOTS} on a CPU; on a GPU "
        "as many as fit in free memory at the full 3000-frame context (the server log says how many and why).")
    idle_timeout_s: float = parameter(
        IDLE_TIMEOUT_S, positive_seconds,
        "A conversation with nothing pending this long is closed; slots of conversations silent this long are given "
        "to new ones when all are taken.")
    dtype: str = parameter("auto", one_of("auto", "float32", "bfloat16"),
                           "The LM's dtype: auto (bfloat16 on a GPU, as published; float32 on a CPU), float32, "
                           "bfloat16.")
    kv_dtype: str = parameter(
        "auto", one_of("auto", "bfloat16", "float8_e4m3fn"),
        "What the temporal transformer's KV cache stores: auto (the LM's dtype), bfloat16, or float8_e4m3fn (GPU "
        "only: half the bytes a conversation holds and a step reads, so about twice the conversations fit; "
        "values past +-448 saturate).")
    weight_dtype: str = parameter(
        "bfloat16", one_of("bfloat16", "float8_e4m3fn"),
        "The weights of the LM's linear layers (temporal transformer and depformer): bfloat16 (as loaded, in the "
        "LM's dtype) or float8_e4m3fn (CUDA only, refused on a CPU: quantized per output channel at load, about "
        "half the weights' memory and the same tick, so a smaller card or more conversations fit; embeddings, "
        "norms and output heads stay as they are).")
    gpu_memory_gib: float | None = parameter(
        "auto", auto_or(positive("GiB")),
        "What the server may take of its GPU, in GiB (both stages, code2wav's largest tick counted as planned): "
        "the talker's pool is sized within it and its process may reserve no more; a start whose weights, the "
        "memory the plan keeps back and one conversation exceed it is refused before loading, saying why. auto: "
        "the whole card. Ignored on a CPU.")
    persona_cache_size: int = parameter("16", whole(0), "Personas (voice, role prompt) whose prefilled state is "
                                                        "kept: a repeat one starts at once.")
    warm_personas: tuple[str, ...] | None = parameter(
        "all", voice_names, 'Personas prefilled at load (into the cache): "all" voices of the checkpoint, or '
                            'names ("NATF0,NATM0"), each with an empty role prompt; "" none.')
    prefill_chunk_spacing: int = parameter(
        str(tunables.PREFILL_CHUNK_SPACING_TICKS), whole(1),
        "Ticks of the live conversations between two chunks of a new persona's prefill while their frames wait: "
        "more keeps more of their frames on time and makes the newcomer wait longer for its first answer; 1: a "
        "chunk after every tick.")


@dataclass(frozen=True)
class SpeechConfig(TalkerConfig):
    """The one-stub model `speech`: the talker's parameters, and code2wav's pool."""

    code2wav_conversations: int | None = parameter(
        "auto", auto_or(whole(1)),
        f"code2wav's conversation slots: auto: {tunables.CPU_DECODER_SLOTS} on a CPU, {tunables.GPU_DECODER_SLOTS} "
        "on a GPU.")

    def code2wav(self) -> Code2WavConfig:
        """Code2wav's config in this model: its pool, the rest as the talker's."""
        shared = {f.name: getattr(self, f.name) for f in fields(Code2WavConfig)}
        return Code2WavConfig(**{**shared, "max_conversations": self.code2wav_conversations})


MODEL_NAMES = {TalkerConfig: "talker", Code2WavConfig: "code2wav", SpeechConfig: "speech"}
CONFIGS = {name: config for config, name in MODEL_NAMES.items()}


def defaults(config: type[StageConfig]) -> list[tuple[str, str, str]]:
    """(key, default text, help) of each of a model's parameters, in order."""
    return [(f.name, f.metadata["text"], f.metadata["help"]) for f in fields(config)]
