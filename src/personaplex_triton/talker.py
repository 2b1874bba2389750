"""Stage 0: PersonaPlex over a pool of conversation slots, one batched step per tick.

A slot first plays its persona's prefill (one step per tick, whether or not its user has
sent audio), then answers each user frame with one agent frame: the user's 1920 samples are
Mimi-encoded (batched over slots), the temporal transformer and depformer step once (batched),
and the agent's 8 codebooks plus text token come out, aligned for the Mimi decoder.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from . import loaders
from .generation import NUM_AUDIO, SlotGenerator, StepInputs
from .mimi_runtime import StepRunner
from .mimi_stream import MimiSlots
from .persona import Persona, VoicePrompt
from .sampling import SamplingParams


@dataclass
class PrefillStep:
    """What one prefill step forces. `pcm` is Mimi-encoded into the agent codes."""

    text: int
    user: tuple[int, ...] = loaders.SINE_TOKENS
    agent: tuple[int, ...] | None = loaders.SILENCE_TOKENS
    pcm: np.ndarray | None = None
    embedding: torch.Tensor | None = None  # [1, dim]
    runs_model: bool = True
    restore_cache: torch.Tensor | None = None  # applied after the step


def prefill_program(persona: Persona, initial_audio_token: int) -> Iterator[PrefillStep]:
    """PersonaPlex's prefill, in order (the first voice frame only primes Mimi)."""
    pad = loaders.TEXT_PROMPT_PAD
    voice = persona.voice
    if voice.frames is not None:
        for i, frame in enumerate(voice.frames):
            yield PrefillStep(text=pad, agent=None, pcm=frame, runs_model=i > 0)
    else:
        initial = (initial_audio_token,) * NUM_AUDIO
        last = len(voice.embeddings) - 1
        for i, embedding in enumerate(voice.embeddings):
            yield PrefillStep(text=pad, user=initial, agent=initial, embedding=embedding.view(1, -1),
                              restore_cache=voice.cache if i == last else None)
    for _ in range(loaders.PREFILL_SILENCE_FRAMES):
        yield PrefillStep(text=pad)
    for token in persona.text_tokens:
        yield PrefillStep(text=token)
    for _ in range(loaders.PREFILL_SILENCE_FRAMES):
        yield PrefillStep(text=pad)


@dataclass(frozen=True)
class TalkerSetup:
    """How a conversation starts: its persona and sampling settings."""

    persona: Persona
    sampling: SamplingParams


@dataclass
class AgentStep:
    """One step's output for a slot: agent codes [8] (int64) and the text token."""

    codes: np.ndarray
    text_token: int


class PersonaCache:
    """Model state after each persona's prefill (least recently used first out), so that a
    conversation with a persona seen before starts at once instead of after its prefill."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._snapshots: OrderedDict[tuple, dict] = OrderedDict()
        self.on_lookup: Callable[[bool], None] = lambda hit: None  # each get's result, for metrics

    def get(self, key: tuple) -> dict | None:
        snap = self._snapshots.get(key)
        if snap is not None:
            self._snapshots.move_to_end(key)
        self.on_lookup(snap is not None)
        return snap

    def put(self, key: tuple, snap: dict) -> None:
        if self.capacity <= 0:
            return
        self._snapshots[key] = snap
        self._snapshots.move_to_end(key)
        while len(self._snapshots) > self.capacity:
            self._snapshots.popitem(last=False)

    def __contains__(self, key: tuple) -> bool:
        return key in self._snapshots

    def __len__(self) -> int:
        return len(self._snapshots)


class _Slot:
    def __init__(self, program: Iterator[PrefillStep] | None, persona_key: tuple):
        self.program = program
        self.persona_key = persona_key
        self.next: PrefillStep | None = None if program is None else next(program, None)

    @property
    def prefilling(self) -> bool:
        return self.next is not None


class Talker:
    def __init__(self, lm, encoder: StepRunner, tokenizer, num_slots: int, persona_cache_size: int = 0,
                 cuda_graphs: bool = True):
        self.lm = lm
        self.tokenizer = tokenizer
        self.num_slots = num_slots
        self.device = lm.device
        self.generator = SlotGenerator(lm, num_slots, cuda_graphs)
        self.mimi = MimiSlots(encoder, num_slots)
        self.slots: list[_Slot | None] = [None] * num_slots
        self.persona_cache = PersonaCache(persona_cache_size)
        self.last_embeddings: torch.Tensor | None = None  # [S, 1, dim] of the last tick
        self._vocab = tokenizer.get_piece_size()

    def close(self) -> None:
        self.generator.close()

    def start(self, slot: int, setup: "TalkerSetup") -> None:
        persona, params = setup.persona, setup.sampling
        params.validate()
        if params.top_k > self.lm.card or params.top_k_text > self.lm.text_card:
            raise ValueError(f"top-k must be <= {self.lm.card} (audio) and <= {self.lm.text_card} (text)")
        self.generator.start(slot, params)
        self.mimi.reset([slot])
        cached = self.persona_cache.get(persona.key)
        if cached is not None:
            self.generator.restore(slot, cached)
            self.slots[slot] = _Slot(None, persona.key)
        else:
            self.slots[slot] = _Slot(prefill_program(persona, self.lm.initial_token_id), persona.key)

    def stop(self, slot: int) -> None:
        self.slots[slot] = None

    def prefilling(self, slot: int) -> bool:
        state = self.slots[slot]
        return state is not None and state.prefilling

    def text_piece(self, token: int) -> str:
        """The text of a sampled token; padding and other special ids give ''."""
        if token <= loaders.TEXT_PROMPT_PAD or token >= self._vocab:
            return ""
        return self.tokenizer.id_to_piece(token).replace("\u2581", " ")

    @torch.no_grad()
    def tick(self, user_frames: dict[int, np.ndarray]) -> dict[int, AgentStep]:
        """One batched step: prefilling slots play their next prefill step, live slots in
        `user_frames` their 1920-sample frame. Returns the agent step of each live slot answered."""
        prefill = {s: st.next for s, st in enumerate(self.slots) if st is not None and st.prefilling}
        live = {s: f for s, f in user_frames.items() if s not in prefill}
        if not prefill and not live:
            return {}
        voice_frames = {s: step.pcm for s, step in prefill.items() if step.pcm is not None}
        codes = self.mimi.encode({**live, **voice_frames})

        inputs = self._step_inputs(prefill, live, codes)
        tokens, has_output, self.last_embeddings = self.generator.step(inputs)

        for s, step in prefill.items():
            if step.restore_cache is not None:
                self.generator.restore_cache(s, step.restore_cache)
            state = self.slots[s]
            state.next = next(state.program, None)
            if state.next is None:  # prefill done: Mimi starts afresh on the user's audio
                self.mimi.reset([s])
                if state.persona_key not in self.persona_cache:
                    self.persona_cache.put(state.persona_key, self.generator.snapshot(s))
        tokens, has_output = tokens.cpu(), has_output.cpu()
        return {s: AgentStep(tokens[s, 1:1 + NUM_AUDIO].numpy().copy(), int(tokens[s, 0]))
                for s in live if has_output[s]}

    def _step_inputs(self, prefill: dict[int, PrefillStep], live: dict[int, np.ndarray], codes) -> StepInputs:
        S = self.num_slots
        active = torch.zeros(S, dtype=torch.bool)
        user = torch.zeros(S, NUM_AUDIO, dtype=torch.long)
        agent = torch.zeros(S, NUM_AUDIO, dtype=torch.long)
        agent_forced = torch.zeros(S, dtype=torch.bool)
        text = torch.zeros(S, dtype=torch.long)
        text_forced = torch.zeros(S, dtype=torch.bool)
        embeddings, embed_rows = None, None
        for s in live:
            active[s] = True
            user[s] = codes[s]
        for s, step in prefill.items():
            active[s] = step.runs_model
            user[s] = torch.tensor(step.user)
            agent[s] = codes[s] if step.agent is None else torch.tensor(step.agent)
            agent_forced[s] = True
            text[s] = step.text
            text_forced[s] = True
            if step.embedding is not None:
                if embeddings is None:
                    embeddings = torch.zeros(S, 1, self.lm.dim)
                    embed_rows = torch.zeros(S, dtype=torch.bool)
                embeddings[s] = step.embedding
                embed_rows[s] = True
        on_device = [None if t is None else t.to(self.device)
                     for t in (active, user, agent, agent_forced, text, text_forced, embeddings, embed_rows)]
        return StepInputs(*on_device)


def make_voice_bundle(talker: Talker, voice: VoicePrompt) -> dict:
    """Play a WAV voice prompt on slot 0 of an idle talker and return PersonaPlex's `.pt`
    bundle for it: the summed input embeddings of steps 1..N-1 and the ring buffer after."""
    if voice.frames is None:
        raise ValueError("a voice bundle is made from a WAV voice prompt")
    persona = Persona(voice, ())
    if persona.key in talker.persona_cache:
        raise ValueError("this voice's prefill is cached: make bundles on a talker without a persona cache")
    talker.start(0, TalkerSetup(persona, SamplingParams(greedy=True)))
    embeddings = []
    for i in range(len(voice.frames)):
        talker.tick({})
        if i > 0:
            embeddings.append(talker.last_embeddings[0:1].detach().cpu().clone())
    cache = talker.generator.cache[0:1].detach().cpu().clone()
    talker.stop(0)
    return {"embeddings": torch.stack(embeddings, dim=0), "cache": cache}
