"""Stage 0: PersonaPlex over a pool of conversation slots, one batched step per tick.

A slot starts with its persona's prefill, played at once (every prefill token is forced, so
the temporal transformer takes them all in a few passes and the depformer never runs), or
copied from the persona cache; then it answers each user frame with one agent frame: the
user's 1920 samples are Mimi-encoded (batched over slots), the temporal transformer and
depformer step once (batched), and the agent's 8 codebooks plus text token come out, aligned
for the Mimi decoder.
"""

from __future__ import annotations

import itertools
import math
import os
import secrets
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from ..core import loaders, memory_budget, tunables
from ..core.buckets import bucket_for
from ..core.errors import SlotFault
from ..engine.stage import Stage
from ..engine.prefills import Failed, PrefillJob
from ..lm import kv_cache
from ..lm.generation import SlotGenerator
from ..lm.graph_capture import capture_graphs
from ..lm.prefill import prefill_chunks, run_chunks
from ..lm.sampling import SamplingParams
from ..lm.step_inputs import HAS_OUTPUT, POSITION, tick_inputs
from ..lm.token_grid import NUM_AUDIO
from ..mimi.runtime import StepRunner
from ..mimi.stream import MimiSlots
from .persona import Persona, VoicePrompt


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


VOICE_FRAMES_A_CHUNK = 16  # a WAV voice prompt's frames Mimi codes in one chunk of a prefill


def voice_program(voice: VoicePrompt, initial_audio_token: int) -> Iterator[PrefillStep]:
    """The voice prompt's part of the prefill (the first WAV frame only primes Mimi)."""
    pad = loaders.TEXT_PROMPT_PAD
    if voice.frames is not None:
        for i, frame in enumerate(voice.frames):
            yield PrefillStep(text=pad, agent=None, pcm=frame, runs_model=i > 0)
    else:
        initial = (initial_audio_token,) * NUM_AUDIO
        last = len(voice.embeddings) - 1
        for i, embedding in enumerate(voice.embeddings):
            yield PrefillStep(text=pad, user=initial, agent=initial, embedding=embedding.view(1, -1),
                              restore_cache=voice.cache if i == last else None)


def prefill_program(persona: Persona, initial_audio_token: int) -> Iterator[PrefillStep]:
    """PersonaPlex's prefill, in order: voice prompt, silence, role prompt, silence."""
    pad = loaders.TEXT_PROMPT_PAD
    yield from voice_program(persona.voice, initial_audio_token)
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
    """One step's output for a slot: agent codes [8] (int64), the text token, and the tick that
    answered it: (its id, how many frames it answered), which the decoder's tick waits for."""

    codes: np.ndarray
    text_token: int
    tick: tuple[int, int] = (0, 0)


class PersonaCache:
    """Model state after each persona's prefill (least recently used first out), so that a
    conversation with a persona seen before starts at once instead of after its prefill."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.hits = 0
        self._snapshots: OrderedDict[tuple, dict] = OrderedDict()
        self.on_lookup: Callable[[bool], None] = lambda hit: None  # each get's result, for metrics

    def get(self, key: tuple) -> dict | None:
        snap = self._snapshots.get(key)
        if snap is not None:
            self._snapshots.move_to_end(key)
            self.hits += 1
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


class Talker(Stage):
    def __init__(self, lm, encoder: StepRunner, tokenizer, num_slots: int, persona_cache_size: int = 0,
                 cuda_graphs: bool = True, ring_attention: bool = True, kv_dtype: torch.dtype | None = None,
                 encode_after: bool = True):
        """`encode_after`: a tick answers before its user frames' Mimi codes are written, and
        the next tick that steps one of those slots takes them. A step's samples do not depend
        on its own frame's codes (its input is the previous position; the depformer skips the
        user's codebooks), only the next step's do, so the tokens are the same and the encode
        (a sizeable part of a tick) leaves each frame's latency. On a CPU the encode runs on a
        thread of its own while the answers leave and the decoder runs; on a CUDA device it is
        queued on a stream of its own beside the step, and the next tick's step waits for it on
        the GPU, not the host (on a host thread, the tick's thread would wait for it)."""
        self.lm = lm
        self.tokenizer = tokenizer
        self.num_slots = num_slots
        self.device = lm.device
        self.generator = SlotGenerator(lm, num_slots, cuda_graphs, ring_attention, kv_dtype)
        self.graphs = capture_graphs(self.generator)
        self.mimi = MimiSlots(encoder, num_slots)
        self.persona_cache = PersonaCache(persona_cache_size)
        cuda = self.device.type == "cuda"
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="talker-encode", initializer=_yield_cpu) \
            if encode_after and not cuda else None
        self._encode_stream = torch.cuda.Stream(self.device) if encode_after and cuda else None
        # encodes not yet written: (their codes, a future or a QueuedEncode; slots; positions)
        self._encodings: list[tuple] = []
        self._unencoded: dict[int, str] = {}  # slot -> why its last frame has no user codes
        self._prefilling: set[tuple] = set()  # the persona keys a chunked prefill is playing
        # tick ids unique across the talker instances that share a decoder: a random high half
        self._ticks = itertools.count(secrets.randbits(30) << 32)

    def close(self) -> None:
        self.settle()
        if self._encoder is not None:
            self._encoder.shutdown()
        self.generator.close()

    def settle(self, slots=None) -> None:
        """Write the user codes of earlier ticks into the token grid, once their encodes are
        done: of every such tick (`slots` None), or of those that stepped one of `slots` (a tick
        needs its own slots' codes only: with conversations whose frames come at different
        moments, it need not wait for the others' encode), and of any already done. The
        talker's own methods do it first; call it before using the generator or Mimi directly."""
        pending = []
        for encoding in self._encodings:
            future, encoded, positions = encoding
            if slots is not None and not future.done() and slots.isdisjoint(encoded):
                pending.append(encoding)
                continue
            try:
                codes = future.result()
            except Exception as exc:  # those conversations cannot go on: their next tick says so
                self._unencoded.update((s, f"{type(exc).__name__}: {exc}") for s in encoded)
                continue
            self.generator.force_user(encoded, positions, codes)
        self._encodings = pending

    def prefill(self, slot: int, setup: "TalkerSetup") -> None:
        failed = self.prefill_many({slot: setup})
        if slot in failed:
            raise failed[slot]

    def prefill_many(self, setups: dict[int, "TalkerSetup"]) -> Failed:
        """Prefill conversations in their slots together, at once; returns those that could
        not, with why (`begin_prefills`; a persona a chunked prefill is playing meanwhile is
        played again, as nothing else runs until this prefill is done)."""
        failed: Failed = {}
        run_chunks(self._prefill_chunks(setups, failed, wait_for_others=False))
        return failed

    def begin_prefills(self, setups: dict[int, "TalkerSetup"]) -> PrefillJob:
        """Prefill conversations in their slots together, in chunks that other slots may tick
        between (engine/prefills.py): bad settings or a persona that cannot play fail their own
        conversations only.

        Mimi's streaming state is reset once for them all. A persona in the cache is copied
        into all of its slots at once (the copy is the model's whole state: no reset of the
        model first, which is hundreds of PyTorch calls); a new one is prefilled in its first
        slot, freshly reset, a transformer pass a chunk (the first with the setup), then copied
        into the others. A prefill that needs a persona another prefill is playing waits for it,
        then takes it from the cache."""
        return PrefillJob(lambda failed: self._prefill_chunks(setups, failed))

    def _prefill_chunks(self, setups: dict[int, "TalkerSetup"], failed: Failed,
                      wait_for_others: bool = True) -> Iterator[None]:
        self.settle()
        for slot, setup in setups.items():
            self._unencoded.pop(slot, None)
            try:
                setup.sampling.validate()
            except ValueError as exc:
                failed[slot] = exc
        ready = {slot: setup for slot, setup in setups.items() if slot not in failed}
        if not ready:
            return
        self.generator.start_many({slot: setup.sampling for slot, setup in ready.items()}, reset_model=False)
        self.mimi.reset(list(ready))  # a WAV voice prompt is coded from a fresh stream
        by_persona: dict[tuple, list[int]] = {}
        for slot, setup in ready.items():
            by_persona.setdefault(setup.persona.key, []).append(slot)
        for key, slots in by_persona.items():
            try:
                while wait_for_others and key in self._prefilling:  # another prefill will cache it
                    yield
                snap = self.persona_cache.get(key)
                if snap is None:
                    first, slots = slots[0], slots[1:]
                    self.generator.reset_model([first])
                    self._prefilling.add(key)
                    try:
                        inputs = yield from self.play_chunks(first, prefill_program(ready[first].persona,
                                                                                    self.lm.initial_token_id))
                    finally:
                        self._prefilling.discard(key)
                    # its length from the host: read back, it would wait for the passes queued
                    snap = self.generator.snapshot(first, filled=len(inputs))
                    self.persona_cache.put(key, snap)
                    self.settle()  # the encodes of the ticks between the chunks, before Mimi's reset
                    self.mimi.reset([first])  # Mimi starts afresh on the user's audio
                if slots:
                    self.generator.restore(slots, snap)
            except Exception as exc:  # a persona that cannot play fails its own conversations
                failed.update((slot, exc) for slot in by_persona[key])

    def stop(self, slot: int) -> None:
        self._unencoded.pop(slot, None)  # the next prefill resets the slot

    def play(self, slot: int, program: Iterator[PrefillStep]) -> torch.Tensor:
        """Play prefill steps into a started slot at once (prefill.py); returns the
        input embeddings of the steps that ran the model [M, 1, dim]."""
        return run_chunks(self.play_chunks(slot, program))

    def play_chunks(self, slot: int, program: Iterator[PrefillStep]):
        """`play` in chunks, yielding after every VOICE_FRAMES_A_CHUNK frames a WAV voice has
        Mimi code and between transformer passes (prefill.py)."""
        self.settle()
        tokens, embeddings, restores, coded = [], {}, {}, 0
        for step in program:
            agent = step.agent
            if step.pcm is not None:  # a WAV voice's frame: Mimi codes it in the slot's own stream
                if coded and coded % VOICE_FRAMES_A_CHUNK == 0:
                    yield
                    self.settle()  # the encodes of the ticks meanwhile, before Mimi steps again
                agent = self.mimi.encode({slot: step.pcm})[slot].tolist()
                coded += 1
            if not step.runs_model:
                continue
            if step.embedding is not None:
                embeddings[len(tokens)] = step.embedding.view(-1)
            if step.restore_cache is not None:
                restores[len(tokens)] = step.restore_cache
            tokens.append((step.text, *agent, *step.user))
        return (yield from prefill_chunks(
            self.generator, slot, torch.tensor(tokens, dtype=torch.long).view(-1, self.generator.grid.num_codebooks),
            embeddings, restores))

    def text_piece(self, token: int) -> str:
        return text_piece(self.tokenizer, token)

    def slot_table(self, slots: list[int]) -> np.ndarray:
        """A step's slot table: the carried `slots` packed first, then, up to the batch bucket
        (under CUDA graphs), slots not carried, whose rows stay inactive."""
        if not self.generator.graphs.enabled:
            return np.array(slots)
        rows = bucket_for(len(slots), self.generator.buckets)
        carried = set(slots)
        padding = [s for s in range(self.num_slots) if s not in carried][:rows - len(slots)]
        return np.array(slots + padding)

    @torch.no_grad()
    def tick(self, user_frames: dict[int, np.ndarray]) -> dict[int, AgentStep]:
        """One batched step: each slot in `user_frames` plays its 1920-sample frame. Returns the
        agent step of each slot answered (none while inside the model's delays)."""
        self.settle(set(user_frames))
        for slot in user_frames:
            if slot in self._unencoded:  # the engine ends that conversation and steps the rest
                raise SlotFault(slot, f"Mimi-encoding this conversation's last frame failed: {self._unencoded[slot]}")
        if not user_frames:
            return {}
        later = self._encoder is not None or self._encode_stream is not None
        slots = sorted(user_frames)
        user = None if later else self.mimi.encode_rows(user_frames)[1].cpu().numpy()  # rows in `slots` order
        # One packed copy in and one out (step_inputs.py): each PyTorch call lets the stub's
        # other threads take the GIL, and the tick waits to get it back.
        packed = torch.from_numpy(tick_inputs(self.slot_table(slots), len(slots), user))
        before_step = torch.cuda.current_stream(self.device).record_event() if self._encode_stream else None
        out, _ = self.generator.run_step(packed)
        queued = self._queue_encode(user_frames, before_step) if self._encode_stream is not None else None
        out = out.cpu().numpy()  # the encode was queued first: it runs while the host waits for this
        positions = out[:len(slots), POSITION]  # where each slot stepped, where its user codes go
        if queued is not None:
            self._encodings.append((queued, slots, positions))
        answered = [(i, s) for i, s in enumerate(slots) if out[i, HAS_OUTPUT]]
        tick = (next(self._ticks), len(answered))
        answers = {s: AgentStep(out[i, 1:1 + NUM_AUDIO].copy(), int(out[i, 0]), tick) for i, s in answered}
        if self._encoder is not None:  # once the answers are out of the step, which the encode would otherwise delay
            encode = self.mimi.encode_rows
            self._encodings.append((self._encoder.submit(lambda: encode(user_frames)[1]), slots, positions))
        return answers

    def _queue_encode(self, frames: dict[int, np.ndarray], after: torch.cuda.Event) -> "QueuedEncode | Future":
        """The encode of `frames` on the encode stream, after what the main stream queued
        before `after` (the last tick's codes written, resets), not after the step."""
        try:
            self._encode_stream.wait_event(after)
            with torch.cuda.stream(self._encode_stream):
                codes = self.mimi.encode_rows(frames)[1]
                return QueuedEncode(codes, self._encode_stream.record_event())
        except Exception as exc:  # as a thread's encode fails: those conversations' next tick says so
            failed = Future()
            failed.set_exception(exc)
            return failed


class QueuedEncode:
    """An encode queued on a CUDA stream, seen as a done future: its result makes the calling
    thread's stream wait for the encode (on the GPU) and gives its codes, on the device."""

    def __init__(self, codes: torch.Tensor, finished: torch.cuda.Event):
        self._codes, self._finished = codes, finished

    def done(self) -> bool:
        return True

    def result(self) -> torch.Tensor:
        torch.cuda.current_stream(self._codes.device).wait_event(self._finished)
        return self._codes


def _yield_cpu() -> None:
    """The calling thread runs at the lowest priority (nice 19). On a CPU the encode has a whole
    frame (80 ms) before the next tick needs its codes, while the decode of the frame just
    answered, and the next tick once its frame comes, are each a frame's latency: they get the
    cores first and the encode what they leave."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def text_piece(tokenizer, token: int) -> str:
    """The text of a sampled token; padding and other special ids give ''."""
    if token <= loaders.TEXT_PROMPT_PAD or token >= tokenizer.get_piece_size():
        return ""
    return tokenizer.id_to_piece(token).replace("\u2581", " ")


def conversation_bytes(lm, encoder: StepRunner, kv_dtype: torch.dtype) -> int:
    """The GPU memory one slot holds: the temporal transformer's KV cache (of `kv_dtype`) at the
    full context and a Mimi encoder state."""
    mimi = sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in encoder.state_specs)
    return kv_cache.bytes_per_conversation(lm.transformer, kv_dtype) + mimi


def kept_back_bytes(lm, kv_dtype: torch.dtype, decoder_in_process: bool = False) -> int:
    """The GPU memory the pool's sizing leaves beside the pool (`conversations_that_fit` says
    why each part): tunables.GPU_RESERVED_BYTES, a prefill's KV cache and, unless code2wav
    already holds its largest tick in this process, GPU_DECODER_RESERVED_BYTES."""
    decoder = 0 if decoder_in_process else tunables.GPU_DECODER_RESERVED_BYTES
    return tunables.GPU_RESERVED_BYTES + decoder + kv_cache.bytes_per_conversation(lm.transformer, kv_dtype)


def conversations_that_fit(lm, encoder: StepRunner, kv_dtype: torch.dtype,
                           decoder_in_process: bool = False, budget: int | None = None) -> tuple[int, str]:
    """How many conversations fit in the GPU's free memory (`conversation_bytes` each), and why;
    tunables.GPU_RESERVED_BYTES stay free for this process's other needs and one KV cache for the
    buffers of a prefill's graphed passes (prefill_graphs.py). Code2wav's largest tick (the two
    stages' memory, planned together): in a process of its own, GPU_DECODER_RESERVED_BYTES stay
    free for it; built first in this one (`decoder_in_process`, one tick), it already holds that
    memory in this process's caching allocator, which the free memory does not count. `budget`:
    the bytes the server may take of the card (core/memory_budget.py; None: all of it)."""
    card_free, _ = torch.cuda.mem_get_info(lm.device)
    free = card_free if budget is None else \
        memory_budget.free_bytes(budget, card_free, torch.cuda.memory_reserved(lm.device))
    each = conversation_bytes(lm, encoder, kv_dtype)
    prefill = kv_cache.bytes_per_conversation(lm.transformer, kv_dtype)
    decoder = 0 if decoder_in_process else tunables.GPU_DECODER_RESERVED_BYTES
    fit = max(1, (free - kept_back_bytes(lm, kv_dtype, decoder_in_process)) // each)
    decoder_why = ("code2wav's largest tick held in this process" if decoder_in_process else
                   f"{decoder / 2**30:.0f} for code2wav's largest tick")
    return int(min(fit, tunables.GPU_DECODER_SLOTS)), (
        f"auto: {free / 2**30:.1f} GiB free on the GPU"
        f"{'' if budget is None else f' within a budget of {budget / 2**30:.1f} GiB'}, "
        f"{each / 2**30:.2f} GiB per conversation "
        f"({lm.context}-frame {str(kv_dtype).removeprefix('torch.')} KV cache + Mimi state), "
        f"{tunables.GPU_RESERVED_BYTES / 2**30:.0f} GiB kept back, {decoder_why} "
        f"and {prefill / 2**30:.2f} for a prefill's graphed passes, "
        f"at most {tunables.GPU_DECODER_SLOTS} (code2wav's slots)")


def make_voice_bundle(talker: Talker, voice: VoicePrompt) -> dict:
    """Play a WAV voice prompt on slot 0 of an idle talker and return PersonaPlex's `.pt`
    bundle for it: the summed input embeddings of steps 1..N-1 and the ring buffer after."""
    if voice.frames is None:
        raise ValueError("a voice bundle is made from a WAV voice prompt")
    talker.settle()
    talker.generator.start(0, SamplingParams(greedy=True))
    talker.mimi.reset([0])
    embeddings = talker.play(0, voice_program(voice, talker.lm.initial_token_id))
    cache = talker.generator.grid.cache[0:1].detach().cpu().clone()
    talker.stop(0)
    # fresh strides: the saved bytes do not depend on how the embeddings were computed
    return {"embeddings": embeddings[:, None].detach().cpu().clone(memory_format=torch.contiguous_format),
            "cache": cache}
