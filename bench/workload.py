"""What every stage sends: real speech cut into 80 ms frames, and one persona.

Every conversation of a run shares the persona (its own seed each), so after the first
conversation the server starts each one from its persona cache: the figures are of
steady-state frames, and the cost of a new persona's prefill is measured once, apart.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from personaplex_stream import Persona
from personaplex_triton.core import audio
from personaplex_triton.core.paths import REPO_ROOT

USER_WAV = REPO_ROOT / "samples" / "user.wav"
PERSONA = Persona(voice="NATF0", text_prompt="You are a friendly travel agent. You help plan trips.", seed=0)

# The wire type of each persona input, by Persona field (its input is the field's name in capitals).
_DTYPES = {"voice": np.object_, "text_prompt": np.object_, "seed": np.int64, "greedy": np.bool_,
           "temperature": np.float32, "temperature_text": np.float32, "top_k": np.int32, "top_k_text": np.int32}


def frames(count: int) -> np.ndarray:
    """The first `count` 1920-sample frames of samples/user.wav, float32 [count, 1920]; past
    its 99 frames (8 s) the speech starts over."""
    cut = audio.split_frames(audio.read_wav(USER_WAV))
    return np.concatenate([cut] * -(-count // len(cut)))[:count]


def persona_for(conversation: int) -> Persona:
    return dataclasses.replace(PERSONA, seed=conversation)


def new_persona(tag: str) -> Persona:
    """A persona no earlier conversation used (its role prompt names `tag`): the server has
    no cached prefill for it. The tag is spelled in letters: a small tokenizer (the generated
    checkpoints') reads every digit as the same unknown token, which made the prompts of
    different tags one persona to the server's cache."""
    return dataclasses.replace(PERSONA, text_prompt=f"{PERSONA.text_prompt} Your booking code is {spelled(tag)}.")


def spelled(tag: str) -> str:
    """`tag` with each digit as a letter (0 a, 1 b, ... 9 j) and anything else not a letter as a space."""
    return "".join(chr(ord("a") + int(c)) if c.isdigit() else c if c.isalpha() else " " for c in tag).strip()


def persona_values(persona: Persona) -> dict[str, object]:
    """The persona inputs of a start request as {input name: Python value}, set fields only."""
    values = {}
    for field in dataclasses.fields(persona):
        value = getattr(persona, field.name)
        if value is not None:
            values[field.name.upper()] = value
    return values


def persona_arrays(persona: Persona) -> dict[str, np.ndarray]:
    """The same as [1] numpy arrays of their wire types (strings as UTF-8 bytes)."""
    arrays = {}
    for name, value in persona_values(persona).items():
        dtype = _DTYPES[name.lower()]
        arrays[name] = np.array([value.encode() if isinstance(value, str) else value], dtype=dtype)
    return arrays
