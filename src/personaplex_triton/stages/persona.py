"""Personas: a voice prompt and a role (system) prompt, turned into PersonaPlex's prefill.

Prefill, one model step per frame, the user's stream always `SINE_TOKENS`:
voice prompt (agent = the voice's Mimi codes, text = pad), 0.5 s of silence, the system
prompt (one text token per frame, agent = silence), 0.5 s of silence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..core import audio, loaders, tunables
from ..core.contract import FRAME_RATE, FRAME_SAMPLES, SAMPLE_RATE


@dataclass(frozen=True)
class VoicePrompt:
    """A voice as PersonaPlex ships it: a `.pt` bundle or a WAV file.

    bundle: `embeddings` [N-1, 1, 1, dim] (summed input embeddings of voice-prompt steps
    1..N-1) and `cache` [1, 17, ring] (the token ring buffer after them). wav: the frames
    [N, 1920], loudness-normalised, Mimi-encoded as they are played.

    A voice loaded from a file (`source`) pickles as that file's name: a new persona's prefill
    crosses to the talker's process (engine/stage_process.py), which loaded the same voices,
    so a 7B bundle's tensors (megabytes) need not cross the pipe on the engine's loop.
    """

    name: str
    embeddings: torch.Tensor | None = None
    cache: torch.Tensor | None = None
    frames: np.ndarray | None = None
    source: str | None = None  # the file load_voice read it from (resolved)

    @property
    def num_frames(self) -> int:
        return len(self.frames) if self.frames is not None else len(self.embeddings) + 1

    def __reduce__(self):
        if self.source is not None and _LOADED.get(self.source) is self:
            return loaded_voice, (self.source,)
        return VoicePrompt, (self.name, self.embeddings, self.cache, self.frames)  # by value, as made


_LOADED: dict[str, VoicePrompt] = {}  # source -> the voice this process loaded from it (the latest)


def loaded_voice(source: str) -> VoicePrompt:
    """The voice this process loaded from `source`, else loaded now (how a voice unpickles)."""
    voice = _LOADED.get(source)
    return voice if voice is not None else load_voice(Path(source))


def load_voice(path: Path) -> VoicePrompt:
    source = str(Path(path).resolve())
    if path.suffix == ".pt":
        bundle = torch.load(path, map_location="cpu", weights_only=True)
        embeddings, cache = bundle["embeddings"], bundle["cache"]
        if embeddings.dim() != 4 or cache.dim() != 3:
            raise loaders.CheckpointError(f"{path}: not a PersonaPlex voice bundle")
        voice = VoicePrompt(path.name, embeddings=embeddings.float(), cache=cache[0].long(), source=source)
    else:
        pcm = audio.read_wav(path, SAMPLE_RATE)
        pcm = audio.loudness_normalize(pcm, SAMPLE_RATE, loaders.VOICE_PROMPT_LUFS)
        voice = VoicePrompt(path.name, frames=audio.split_frames(pcm.astype(np.float32), FRAME_SAMPLES), source=source)
    _LOADED[source] = voice
    return voice


def wrap_system_prompt(text: str) -> str:
    cleaned = text.strip()
    tag = loaders.SYSTEM_TAG
    if cleaned.startswith(tag) and cleaned.endswith(tag) and len(cleaned) > len(tag):
        return cleaned
    return f"{tag} {cleaned} {tag}"


class PromptTooLong(ValueError):
    """A role or voice prompt over its limit (tunables.MAX_*); the message says which and by how much."""


def system_prompt_tokens(tokenizer, text: str) -> tuple[int, ...]:
    """The prompt's text tokens; an empty prompt prefills no text (the reference crashes)."""
    if not text.strip():
        return ()
    if len(text) > tunables.MAX_ROLE_PROMPT_CHARS:
        raise PromptTooLong(f"TEXT_PROMPT has {len(text)} characters; the limit is {tunables.MAX_ROLE_PROMPT_CHARS}")
    tokens = tuple(tokenizer.encode(wrap_system_prompt(text)))
    if len(tokens) > tunables.MAX_ROLE_PROMPT_TOKENS:
        raise PromptTooLong(f"TEXT_PROMPT is {len(tokens)} tokens long; the limit is {tunables.MAX_ROLE_PROMPT_TOKENS}")
    return tokens


@dataclass(frozen=True)
class Persona:
    voice: VoicePrompt
    text_tokens: tuple[int, ...]

    @property
    def key(self) -> tuple:
        """What the prefill depends on: the voice file and the prompt's tokens (not the
        sampling settings: every prefill token is forced)."""
        return (self.voice.name, self.text_tokens)


class PersonaLibrary:
    """The voices of a checkpoint, all loaded up front (a voice's first use must not load and
    normalise a file on the request path), and the tokenizer for role prompts. `only`: just
    these voices (names as requests give them), for a load's warm personas."""

    def __init__(self, files: loaders.CheckpointFiles, tokenizer, only: list[str] | None = None):
        self.files = files
        self.tokenizer = tokenizer
        names = files.voice_names()
        if not names:
            raise loaders.CheckpointError(f"checkpoint {files.root} has no voices")
        self.default_voice = names[0]
        paths = ([files.voice_path(name) for name in only] if only is not None else
                 [path for path in sorted(files.voices.iterdir()) if path.suffix in (".pt", ".wav")])
        self._voices = {path: load_voice(path) for path in paths}

    def voice(self, name: str | None) -> VoicePrompt:
        path = self.files.voice_path(name or self.default_voice)
        voice = self._voices.get(path)
        if voice is None:
            raise loaders.CheckpointError(f"voice {path.name} was added after the model loaded; reload the model")
        if voice.num_frames > tunables.MAX_VOICE_PROMPT_FRAMES:
            raise PromptTooLong(
                f"voice {voice.name!r} is {voice.num_frames} frames long; the limit is "
                f"{tunables.MAX_VOICE_PROMPT_FRAMES} ({tunables.MAX_VOICE_PROMPT_FRAMES / FRAME_RATE:g} s)")
        return voice

    def persona(self, voice: str | None, text_prompt: str) -> Persona:
        return Persona(self.voice(voice), system_prompt_tokens(self.tokenizer, text_prompt))
