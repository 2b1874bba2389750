"""What one request of a conversation carries: a frame of user audio, the persona on the
first, and the sequence id that ties the requests into one Triton sequence."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Optional

import numpy as np
import tritonclient.grpc as grpcclient

from . import contract


@dataclass
class Persona:
    """Persona options of a conversation; `None` fields are not sent (server defaults).

    voice: a voice name of the checkpoint, e.g. "NATF0"; text_prompt: the role prompt;
    seed: sampling seed; greedy: argmax instead of sampling; temperature / top_k: audio
    sampling; temperature_text / top_k_text: text sampling.
    """

    voice: Optional[str] = None
    text_prompt: Optional[str] = None
    seed: Optional[int] = None
    greedy: Optional[bool] = None
    temperature: Optional[float] = None
    temperature_text: Optional[float] = None
    top_k: Optional[int] = None
    top_k_text: Optional[int] = None


# Persona field -> the start request's input of that name.
PERSONA_FIELDS = {"voice": contract.VOICE, "text_prompt": contract.TEXT_PROMPT, "seed": contract.SEED,
                  "greedy": contract.GREEDY, "temperature": contract.TEMPERATURE,
                  "temperature_text": contract.TEMPERATURE_TEXT, "top_k": contract.TOP_K,
                  "top_k_text": contract.TOP_K_TEXT}


def _tensor(name: str, value) -> grpcclient.InferInput:
    """An input of the contract, its datatype and numpy dtype taken from `contract.SPECS`."""
    datatype = contract.SPECS[name].datatype
    array = np.asarray(value, dtype=contract.NUMPY_DTYPES[datatype])
    t = grpcclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def build_persona_inputs(persona: Optional[Persona]) -> list:
    """The persona InferInputs of the first request: one [1] tensor per given field."""
    if persona is None:
        return []
    inputs = []
    for field_name, name in PERSONA_FIELDS.items():
        value = getattr(persona, field_name)
        if value is not None:
            inputs.append(_tensor(name, [value.encode("utf-8") if isinstance(value, str) else value]))
    return inputs


def build_request_inputs(frame: np.ndarray, persona: Optional[Persona] = None, first: bool = False) -> list:
    """The InferInputs of one request: AUDIO_IN FP32 [1920], plus the persona if `first`."""
    frame = np.ascontiguousarray(frame, dtype=np.float32).reshape(-1)
    if frame.size != contract.FRAME_SAMPLES:
        raise ValueError(f"a frame has {contract.FRAME_SAMPLES} samples, got {frame.size}")
    inputs = [_tensor(contract.AUDIO_IN, frame)]
    if first:
        inputs.extend(build_persona_inputs(persona))
    return inputs


def build_end_inputs() -> list:
    """The InferInputs of an end request without audio: AUDIO_IN FP32 [0]."""
    return [_tensor(contract.AUDIO_IN, np.zeros(0, np.float32))]


def requested_outputs() -> list:
    """The outputs every request asks for: the agent's audio and text piece."""
    return [grpcclient.InferRequestedOutput(contract.AUDIO_OUT), grpcclient.InferRequestedOutput(contract.TEXT_OUT)]


def new_sequence_id() -> int:
    """A random nonzero 63-bit sequence id (fits Triton's int64 sequence_id parameter)."""
    while True:
        sid = secrets.randbits(63)
        if sid != 0:
            return sid


def checked_sequence_id(sequence_id: Optional[int]) -> int:
    """`sequence_id` as an int, a new random one when None; ValueError outside [1, 2**63)."""
    if sequence_id is None:
        sequence_id = new_sequence_id()
    if not (0 < int(sequence_id) < 2**63):
        raise ValueError("sequence_id must be in [1, 2**63)")
    return int(sequence_id)
