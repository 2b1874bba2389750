"""The two stages as Triton sees them: numpy tensors in, numpy tensors out, per request.

The `model.py` files only move tensors between Triton and these services, so everything
here is tested without a server. A service answers through two callbacks per request:
`send(outputs, last)` once per frame, in order, `last` on the request's last frame (its response
completes the request: one response where Triton would take two), and `finish(error)` once at
the end (after a last frame, it has nothing left to say).
"""

from __future__ import annotations

import logging
import secrets
from typing import Callable

import numpy as np

from ..core import contract, loaders, metrics as reasons, seam, tunables
from ..core.fault_injection import FaultPlan
from ..core.metrics import Metrics
from ..engine.engine import ConversationError, SlotEngine
from ..lm.sampling import SamplingParams
from ..stages.code2wav import CodesFrame, tick_group
from ..stages.persona import PromptTooLong
from ..stages.talker import text_piece
from .parameters import Code2WavConfig, TalkerConfig
from .stage_builds import StageInfo, build_code2wav, build_talker, open_stage, use_device_threads

log = logging.getLogger(__name__)

Send = Callable[[dict, bool], None]
Finish = Callable[[str | None], None]
IsCancelled = Callable[[], bool]


class InputError(ValueError):
    """A request that breaks the wire contract; the message names the problem."""

    reason = reasons.INVALID_INPUT


class LimitError(InputError):
    """A request over one of the documented limits (tunables.MAX_*)."""

    reason = reasons.LIMIT


def audio_frames(audio: np.ndarray | None) -> np.ndarray:
    """AUDIO_IN -> [n, FRAME_SAMPLES] float32, or InputError saying what is wrong."""
    if audio is None:
        raise InputError(f"missing input {contract.AUDIO_IN}")
    if audio.dtype != np.float32:
        raise InputError(f"{contract.AUDIO_IN} must be FP32, got {audio.dtype}")
    if audio.ndim != 1:
        raise InputError(f"{contract.AUDIO_IN} must be 1-D, got shape {list(audio.shape)}")
    if audio.size % contract.FRAME_SAMPLES:
        raise InputError(
            f"{contract.AUDIO_IN} must hold a whole number of {contract.FRAME_SAMPLES}-sample frames, "
            f"got {audio.size} samples")
    if audio.size > tunables.MAX_FRAMES_PER_REQUEST * contract.FRAME_SAMPLES:
        raise LimitError(f"{contract.AUDIO_IN} holds {audio.size // contract.FRAME_SAMPLES} frames; the limit "
                         f"is {tunables.MAX_FRAMES_PER_REQUEST} per request")
    if not np.isfinite(audio).all():
        raise InputError(f"{contract.AUDIO_IN} holds NaN or infinite samples")
    if audio.size and np.abs(audio).max() > 1.0:
        raise InputError(f"{contract.AUDIO_IN} samples must lie in [-1, 1], got peak {np.abs(audio).max():.3g}")
    return audio.reshape(-1, contract.FRAME_SAMPLES)


def _scalar(arrays: dict, name: str, kind: type):
    value = arrays.get(name)
    if value is None:
        return None
    if value.size != 1:
        raise InputError(f"{name} must hold one value, got shape {list(value.shape)}")
    value = value.reshape(-1)[0]
    if kind is str:
        if not isinstance(value, (bytes, np.bytes_, str)):
            raise InputError(f"{name} must be BYTES")
        try:
            return value.decode("utf-8") if isinstance(value, (bytes, np.bytes_)) else str(value)
        except UnicodeDecodeError as exc:
            raise InputError(f"{name} is not valid UTF-8") from exc
    try:
        return kind(value)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{name} must be a number") from exc


def sampling_params(arrays: dict) -> SamplingParams:
    """The start request's sampling inputs; without SEED, a fresh random seed."""
    params = SamplingParams(seed=secrets.randbits(63))
    for name, attr, kind in ((contract.SEED, "seed", int), (contract.GREEDY, "greedy", bool),
                             (contract.TEMPERATURE, "temperature", float),
                             (contract.TEMPERATURE_TEXT, "temperature_text", float),
                             (contract.TOP_K, "top_k", int), (contract.TOP_K_TEXT, "top_k_text", int)):
        value = _scalar(arrays, name, kind)
        if value is not None:
            setattr(params, attr, value)
    try:
        params.validate()
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    return params


def refuse(finish: Finish, error: InputError | ConversationError, metrics: Metrics) -> None:
    metrics.rejected(error.reason)
    finish(str(error))


def load_log_lines(model: str, info: StageInfo, send_threads: int) -> list[str]:
    """What a stage's model logs once loaded, for people: its Mimi runtime, its pool, its send
    threads and, for the talker, the personas prefilled (programs read the same from the
    model's metrics: core/metrics.stage_setups)."""
    lines = [f"{model}: {info.mimi}", f"{model}: {info.slots} conversation slots ({info.slots_why})",
             f"{model}: {send_threads} send thread(s)"]
    if info.warmed is not None:
        lines.append(f"{model}: personas prefilled at load: {', '.join(info.warmed) or 'none'}")
    return lines


class TalkerService:
    """Stage 0: user audio frames in, one agent frame (codes + text) out per input frame.
    With `config.stage_process` the talker (its model and its ticks) runs in a process of its
    own (engine/stage_process.py), so that its ticks never wait for this process's GIL.
    `downstream_behind_s`: the engine's (SlotEngine), code2wav's send backlog, as its stub
    writes it (sends_gauge.py)."""

    def __init__(self, config: TalkerConfig, metrics: Metrics | None = None,
                 downstream_behind_s: Callable[[], float] | None = None):
        from ..stages.persona import PersonaLibrary

        self.config = config = config.resolved()
        self.metrics = metrics or Metrics()
        use_device_threads(config.device)
        files = loaders.resolve_checkpoint(config.checkpoint)
        self.tokenizer = loaders.get_tokenizer(files)
        self.personas = PersonaLibrary(files, self.tokenizer)
        self.talker, self.info = self._open_stage(config)
        # Admission by time and by the sends on a GPU; on a CPU the pool alone (a shared
        # VM's few cores stall ticks and sends now and then, and its pool is a handful).
        self.engine = SlotEngine(self.talker, name="talker", evict_after_s=config.idle_timeout_s,
                                 idle_timeout_s=config.idle_timeout_s, metrics=self.metrics,
                                 faults=FaultPlan.from_env(),
                                 admission_tick_s=tunables.GPU_ADMISSION_TICK_S if config.on_gpu else 0.0,
                                 admission_latency_s=tunables.GPU_ADMISSION_LATENCY_S if config.on_gpu else 0.0,
                                 admit_by_sends=config.on_gpu, chunk_spacing_ticks=config.prefill_chunk_spacing,
                                 send_threads=config.send_threads, downstream_behind_s=downstream_behind_s)
        self.metrics.loaded(self.info.slots, self.engine.send_threads, "encoder", self.info.mimi_runtime, self.info.warmed,
                            self.info.kv_dtype)

    def handle(self, conversation: int, start: bool, end: bool, arrays: dict, send: Send, finish: Finish,
               is_cancelled: IsCancelled | None = None) -> None:
        try:
            frames = audio_frames(arrays.get(contract.AUDIO_IN))
            if end and len(frames) > 1:
                # code2wav's sequence batcher ends the conversation at the first frame that
                # carries the request's end flag, and the ensemble gives it to every frame.
                raise InputError(f"the sequence-end request carries at most one frame, got {len(frames)}")
            if start:
                self.engine.open(conversation, self._setup(arrays))
            elif any(name in arrays for name in contract.PERSONA_INPUTS):
                raise InputError(f"persona inputs ({', '.join(contract.PERSONA_INPUTS)}) are only "
                                 "accepted on the sequence-start request")
        except (InputError, ConversationError) as exc:
            if end and not start and self.engine.is_open(conversation):
                self.engine.submit(conversation, [], None, lambda _: None, close=True)
            refuse(finish, exc, self.metrics)
            return
        if end and not start and not len(frames) and not self.engine.is_open(conversation):
            # An end without audio for a conversation that is not open asks for what already
            # holds: a client's clean-up after a refused start or a failure, which ends its
            # Triton sequence at once rather than at the sequence batcher's idle timeout.
            finish(None)
            return

        def on_output(step, index, last):
            send(self._answer(conversation, step, index, end and last), last)

        def finish_with_close(error):
            """An end request without frames: a later stage hears of the end through a close marker."""
            marker = self._close_marker(conversation)
            if error is None and marker is not None:
                send(marker, True)
            finish(error)

        try:
            self.engine.submit(conversation, list(frames), on_output,
                               finish_with_close if end and not len(frames) else finish,
                               close=end, is_cancelled=is_cancelled)
        except ConversationError as exc:
            refuse(finish, exc, self.metrics)

    def _open_stage(self, config: TalkerConfig):
        """(the engine's stage, StageInfo) of the config."""
        return open_stage("talker", build_talker, config, self.metrics)

    def _answer(self, conversation: int, step, index: int, final: bool) -> dict:
        """A stage's output for a frame (stages/talker.AgentStep), as the response's tensors."""
        return seam_frame(conversation, index, final, step.codes.astype(np.int64),
                          text_piece(self.tokenizer, step.text_token), step.tick)

    def _close_marker(self, conversation: int) -> dict | None:
        """What answers an end request without frames (None: nothing, only the request's end)."""
        return seam_frame(conversation, seam.CLOSE_ONLY, True, np.zeros(seam.NUM_AGENT_CODEBOOKS, np.int64), "")

    def _setup(self, arrays: dict):
        from ..stages.talker import TalkerSetup

        voice = _scalar(arrays, contract.VOICE, str)
        prompt = _scalar(arrays, contract.TEXT_PROMPT, str) or ""
        try:
            persona = self.personas.persona(voice, prompt)
        except loaders.CheckpointError as exc:
            raise InputError(str(exc)) from exc
        except PromptTooLong as exc:
            raise LimitError(str(exc)) from exc
        return TalkerSetup(persona, sampling_params(arrays))

    def drain(self, drain_s: float) -> None:
        """No new conversations or requests (an error naming the shutdown); pending requests
        finish, or get that error after `drain_s`."""
        self.engine.shutdown(drain_s)

    def close(self) -> None:
        self.engine.shutdown()
        self.talker.close()
        self.metrics.close()


def seam_frame(conversation: int, index: int, final: bool, codes: np.ndarray, text: str,
               tick: tuple[int, int] = seam.ALONE) -> dict:
    return {
        seam.AGENT_CODES: codes,
        seam.CONVERSATION_ID: np.array([conversation], dtype=np.uint64),
        seam.FRAME_INDEX: np.array([index], dtype=np.int64),
        seam.FINAL: np.array([final], dtype=bool),
        seam.TEXT_PIECE: np.array([text.encode()], dtype=np.object_),
        seam.TICK: np.array(tick, dtype=np.int64),
    }


class Code2WavService:
    """Stage 1: one frame of agent codes in, 1920 samples of 24 kHz audio out.
    `config.stage_process`: as the talker's (TalkerService)."""

    def __init__(self, config: Code2WavConfig, metrics: Metrics | None = None):
        self.config = config = config.resolved()
        self.metrics = metrics or Metrics()
        use_device_threads(config.device)
        self.code2wav, self.info = open_stage("code2wav", build_code2wav, config, self.metrics)
        # Its conversations end when the talker says so (FINAL), or get replaced once idle, or
        # are closed after the idle timeout (a talker conversation that failed sends no FINAL).
        # The talker admits them: code2wav refuses none for time or for its sends.
        self.engine = SlotEngine(self.code2wav, name="code2wav", evict_after_s=0.0,
                                 idle_timeout_s=config.idle_timeout_s, metrics=self.metrics, gather=tick_group,
                                 gather_max_s=tunables.CODE2WAV_GATHER_MAX_S, send_threads=config.send_threads)
        self.metrics.loaded(self.info.slots, self.engine.send_threads, "decoder", self.info.mimi_runtime)

    def handle(self, arrays: dict, send: Send, finish: Finish) -> None:
        try:
            codes = arrays.get(seam.AGENT_CODES)
            if codes is None or codes.shape != (seam.NUM_AGENT_CODEBOOKS,) or codes.dtype != np.int64:
                raise InputError(f"{seam.AGENT_CODES} must be INT64 [{seam.NUM_AGENT_CODEBOOKS}]")
            if codes.min() < 0 or codes.max() >= seam.CODEBOOK_SIZE:
                raise InputError(f"{seam.AGENT_CODES} must lie in [0, {seam.CODEBOOK_SIZE})")
            conversation = _scalar(arrays, seam.CONVERSATION_ID, int)
            frame_index = _scalar(arrays, seam.FRAME_INDEX, int)
            final = _scalar(arrays, seam.FINAL, bool)
            if conversation is None or frame_index is None or final is None:
                raise InputError(f"{seam.CONVERSATION_ID}, {seam.FRAME_INDEX} and {seam.FINAL} are required")
            text = arrays.get(seam.TEXT_PIECE)
            tick = arrays.get(seam.TICK)
            if tick is not None and (tick.shape != (2,) or tick.dtype != np.int64 or tick[1] < 1):
                raise InputError(f"{seam.TICK} must be INT64 [2]: a talker tick's id and its frames (>= 1)")
            if frame_index == seam.CLOSE_ONLY:
                if final and self.engine.is_open(conversation):
                    self.engine.submit(conversation, [], None, finish, close=True)
                else:
                    finish(None)
                return
            if frame_index == 0:
                self.engine.open(conversation, None, restart=True)
        except (InputError, ConversationError) as exc:
            refuse(finish, exc, self.metrics)
            return
        text_out = np.array([b""], dtype=np.object_) if text is None else text.reshape(1)

        def on_output(pcm, _index, last):
            send({contract.AUDIO_OUT: pcm.astype(np.float32), contract.TEXT_OUT: text_out}, last)

        try:
            frame = CodesFrame(codes, None if tick is None else (int(tick[0]), int(tick[1])))
            self.engine.submit(conversation, [frame], on_output, finish, close=final, first_index=frame_index)
        except ConversationError as exc:
            refuse(finish, exc, self.metrics)

    def close(self) -> None:
        self.engine.shutdown()
        self.code2wav.close()
        self.metrics.close()
