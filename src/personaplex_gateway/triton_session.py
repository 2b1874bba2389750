"""One WebSocket = one Triton sequence on the `ensemble` model, over one gRPC stream.

The start request carries the persona and one frame of silence: its answer comes once the
persona is prefilled, which is how the gateway knows the conversation is ready (the answer
itself is not passed on, so a client gets one frame out per frame in). Then each whole
1920-sample frame of the client's audio goes in as it is due (`AudioPacer`), and each answer
goes back as it arrives. Closing sends an end request at once, so the talker frees the slot
now rather than at its idle timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpc
from personaplex_stream import Persona, build_end_inputs, build_request_inputs, new_sequence_id
from personaplex_stream import contract
from tritonclient.utils import InferenceServerException

from .framing import FRAME_SAMPLES, FRAME_SECONDS, FrameBuffer
from .limits import CLOSE_POLICY, CLOSE_SERVER_ERROR, CLOSE_TRY_AGAIN_LATER, AudioPacer, GatewayError, Limits

log = logging.getLogger("personaplex_gateway")

STAGES = ("talker", "code2wav")  # each holds its own pool of conversation slots
END_GRACE_S = 5.0  # after the end request, how long the server may take to finish the stream


@dataclass(frozen=True)
class TritonTLS:
    """Files for a TLS channel to Triton: the CA that signed the server's certificate (None:
    the system's roots) and, for mutual TLS, the gateway's own key and certificate."""

    root_certificates: str | None = None
    private_key: str | None = None
    certificate_chain: str | None = None


class TritonChannel:
    """The gateway's one gRPC channel to Triton; every conversation's stream shares it.
    Create it inside the running event loop (grpc.aio binds to it)."""

    def __init__(self, url: str, tls: TritonTLS | None = None, model_name: str = contract.MODEL_NAME):
        self.url = url
        self.model_name = model_name
        if tls is None:
            self.client = aiogrpc.InferenceServerClient(url)
        else:
            self.client = aiogrpc.InferenceServerClient(
                url, ssl=True, root_certificates=tls.root_certificates, private_key=tls.private_key,
                certificate_chain=tls.certificate_chain)

    async def is_ready(self, timeout_s: float = 2.0) -> bool:
        try:
            return (await self.client.is_server_ready(client_timeout=timeout_s)
                    and await self.client.is_model_ready(self.model_name, client_timeout=timeout_s))
        except InferenceServerException:
            return False

    async def capacity(self) -> int | None:
        """The conversations the server holds, from its stages' model configurations: the
        smaller of the talker's and code2wav's `max_conversations` times their instances, where
        both are numbers; None where one is `auto` (the stage sizes its pool at load) or a
        configuration cannot be read."""
        slots = []
        for model in STAGES:
            try:
                config = (await self.client.get_model_config(model, as_json=True))["config"]
            except (InferenceServerException, KeyError):
                return None
            value = config.get("parameters", {}).get("max_conversations", {}).get("string_value", "")
            if not value.isdigit():
                return None
            instances = sum(int(group.get("count", 1)) for group in config.get("instance_group", [])) or 1
            slots.append(int(value) * instances)
        return min(slots)

    async def close(self) -> None:
        await self.client.close()


class FrameTimings:
    """Time the gateway itself spends on frames, kept for the last `keep` frames: `inbound_ms`
    from the client's message that completed a frame to its write on the stream (less any
    wait for its turn under pacing) to its hand-over to the gRPC stream, `outbound_ms` from
    Triton's answer to its send on the socket; and, to tell the two apart from what a client
    sees, `triton_ms` from a frame's hand-over to its answer."""

    def __init__(self, keep: int = 20_000):
        self.inbound_ms: deque = deque(maxlen=keep)
        self.outbound_ms: deque = deque(maxlen=keep)
        self.triton_ms: deque = deque(maxlen=keep)
        self.frames_in = 0
        self.frames_out = 0

    def summary(self) -> dict:
        def pct(values) -> dict:
            if not values:
                return {"p50": None, "p95": None, "p99": None, "max": None}
            arr = np.asarray(values, dtype=np.float64)
            return {**{f"p{q}": round(float(np.percentile(arr, q)), 3) for q in (50, 95, 99)},
                    "max": round(float(arr.max()), 3)}

        return {"frames_in": self.frames_in, "frames_out": self.frames_out,
                "inbound_ms": pct(self.inbound_ms), "outbound_ms": pct(self.outbound_ms),
                "triton_ms": pct(self.triton_ms)}


@dataclass(frozen=True)
class Answer:
    """One frame of the agent: 1920 samples, its text piece ("" mostly), its index from 0, and
    when it arrived from Triton (perf_counter)."""

    pcm: np.ndarray
    text: str
    index: int
    received_at: float


@dataclass(frozen=True)
class _Frame:
    index: int
    samples: np.ndarray
    arrived_at: float


_END = object()
_OUTPUTS = (contract.AUDIO_OUT, contract.TEXT_OUT)


def _error_code(message: str) -> tuple[str, int]:
    """The code and close code of an error the server sent."""
    if "unknown voice" in message:
        return "unknown_voice", CLOSE_POLICY
    if "must lie in" in message or "must be a finite number" in message:  # a sampling setting out of range
        return "invalid_parameter", CLOSE_POLICY
    if "at capacity" in message or "shutting down" in message:  # no slot, or the tick model is full
        return "server_full", CLOSE_TRY_AGAIN_LATER
    return "server_error", CLOSE_SERVER_ERROR


def _text_of(result) -> str:
    text = result.as_numpy(contract.TEXT_OUT)
    if text is None or text.size == 0:
        return ""
    value = text.reshape(-1)[0]
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


class TritonSession:
    """One conversation's sequence. `start()` opens it and returns once the persona is ready;
    `feed()` takes the client's audio; `answers()` yields the agent's frames; `close()` ends it."""

    def __init__(self, channel: TritonChannel, persona: Persona, limits: Limits, timings: FrameTimings):
        self.channel = channel
        self.persona = persona
        self.timings = timings
        self.sequence_id = new_sequence_id()
        self._frames = FrameBuffer()
        self._pacer = AudioPacer(limits.audio_burst_s, limits.audio_max_ahead_s)
        self._unsent_max_s = limits.unsent_max_s
        self._queue: asyncio.Queue = asyncio.Queue()
        self._answers: asyncio.Queue = asyncio.Queue()
        self._ready = asyncio.Event()
        self._closing = asyncio.Event()
        self._frames_fed = 0
        self._handed_over: dict[int, float] = {}  # frame index -> when it went to the stream
        self._stream = None
        self._reader: asyncio.Task | None = None
        self._outputs = [grpcclient.InferRequestedOutput(name) for name in _OUTPUTS]

    async def start(self) -> None:
        """Open the stream with the persona; raises GatewayError where the server refuses it."""
        try:
            self._stream = self.channel.client.stream_infer(self._requests())
        except InferenceServerException as exc:
            raise GatewayError("triton_unavailable", f"cannot open a stream to Triton: {exc}", CLOSE_SERVER_ERROR)
        self._reader = asyncio.ensure_future(self._read())
        first = await self._answers.get()
        if isinstance(first, GatewayError):
            raise first
        if first is None:
            raise GatewayError("server_error", "Triton ended the stream before the persona was ready",
                               CLOSE_SERVER_ERROR)
        self._pacer.open(time.perf_counter(), self._queue.qsize())
        self._ready.set()

    def feed(self, samples: np.ndarray, received_at: float) -> None:
        """Queue the client's audio (float32, 24 kHz mono) from a message received at `received_at`
        (perf_counter, before it was decoded); GatewayError where it comes too fast, or where
        the client leaves too much of the agent's audio unread (its socket's buffers full, the
        answers would pile up here for as long as it talks)."""
        unsent_s = self._answers.qsize() * FRAME_SECONDS  # an answer a frame
        if unsent_s > self._unsent_max_s:
            raise GatewayError("client_too_slow", f"the client has left {unsent_s:.2f} s of the agent's audio unread "
                               f"(the limit is {self._unsent_max_s:g} s); the conversation ends", CLOSE_POLICY)
        for frame in self._frames.push(samples):
            self._pacer.arrive(self._frames_fed, received_at)
            self._queue.put_nowait(_Frame(self._frames_fed, frame, received_at))
            self._frames_fed += 1

    async def answers(self) -> AsyncIterator[Answer]:
        """The agent's frames in order, until the stream ends; GatewayError where it fails."""
        while True:
            item = await self._answers.get()
            if item is None:
                return
            if isinstance(item, GatewayError):
                raise item
            yield item

    async def close(self) -> None:
        """End the sequence now: frames not yet sent are dropped, the end request goes at once,
        and the stream is cancelled if the server does not finish it within END_GRACE_S."""
        if self._closing.is_set():
            return
        self._closing.set()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(_END)
        if self._reader is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), END_GRACE_S)
        except asyncio.TimeoutError:
            log.warning("sequence %d: the stream did not end within %.0f s of its end request; cancelled",
                        self.sequence_id, END_GRACE_S)
            self._stream.cancel()
            self._reader.cancel()

    # -- the stream's two directions -------------------------------------------------------
    def _request(self, inputs: list, start: bool = False, end: bool = False) -> dict:
        return {"model_name": self.channel.model_name, "inputs": inputs, "outputs": self._outputs,
                "sequence_id": self.sequence_id, "sequence_start": start, "sequence_end": end}

    async def _requests(self):
        yield self._request(build_request_inputs(np.zeros(FRAME_SAMPLES, np.float32), self.persona, first=True),
                            start=True)
        await self._either(self._ready.wait())
        while True:
            item = await self._queue.get()
            if item is _END:
                break
            due = self._pacer.due(item.index)
            wait = due - time.perf_counter()
            if wait > 0 and await self._either(asyncio.sleep(wait)):
                continue  # closing: the end request is queued next
            turn = max(item.arrived_at, due)  # its arrival, or its turn where pacing (or the persona) held it
            self.timings.inbound_ms.append((time.perf_counter() - turn) * 1e3)
            self.timings.frames_in += 1
            self._handed_over[item.index] = time.perf_counter()
            yield self._request(build_request_inputs(item.samples))
        yield self._request(build_end_inputs(), end=True)

    async def _either(self, awaitable) -> bool:
        """Await `awaitable` unless the session closes first; True where it closed."""
        waiting = asyncio.ensure_future(awaitable)
        closing = asyncio.ensure_future(self._closing.wait())
        done, pending = await asyncio.wait({waiting, closing}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return closing in done

    async def _read(self) -> None:
        index = -1  # the priming frame's answer is -1: it only says the persona is ready
        try:
            async for result, error in self._stream:
                now = time.perf_counter()
                if error is not None:
                    message = error.message() if isinstance(error, InferenceServerException) else str(error)
                    code, close_code = _error_code(message)
                    self._answers.put_nowait(GatewayError(code, message, close_code))
                    return
                if not result.get_response().outputs:
                    continue
                pcm = result.as_numpy(contract.AUDIO_OUT)
                answer = Answer(np.asarray(pcm, np.float32).reshape(-1), _text_of(result), index, now)
                handed_over = self._handed_over.pop(index, None)
                if handed_over is not None:
                    self.timings.triton_ms.append((now - handed_over) * 1e3)
                self._answers.put_nowait(answer)
                index += 1
        except (grpc.aio.AioRpcError, InferenceServerException) as exc:
            if not self._closing.is_set():
                details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                self._answers.put_nowait(GatewayError("triton_unavailable", f"the stream to Triton broke: {details}",
                                                      CLOSE_SERVER_ERROR))
                return
        except asyncio.CancelledError:
            pass
        self._answers.put_nowait(None)
