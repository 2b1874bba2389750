"""Collecting a conversation's answers: the stream's responses, taken in order on the calling
thread, checked against the wire contract and timed against their frames' sends.

The server answers each request with one response holding the agent's 80 ms of audio
(AUDIO_OUT) and text piece (TEXT_OUT), in order; with `enable_empty_final_response` a
request's last response is flagged final, and where no frame is left to carry the flag it
comes alone, without outputs: skipped here.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from . import contract
from .errors import (
    ConnectionLostError,
    ProtocolError,
    ServerError,
    ServerUnreachableError,
    StreamError,
    StreamTimeoutError,
    error_text,
    grpc_status,
    is_unavailable,
)
from .report import ConversationResult


@dataclass(frozen=True)
class AnsweredFrame:
    """One frame's answer as it arrives: its index (from 0) of `total`, its latency (send to
    answer) and the agent's text piece for it ("" mostly)."""

    index: int
    total: int
    latency_ms: float
    text: str


def is_final_response(result) -> bool:
    """Whether a streamed result (an InferResult) completes its request: with
    `enable_empty_final_response`, Triton marks the request's last response so, whether it
    carries a frame or is flag-only."""
    param = result.get_response().parameters.get("triton_final_response")
    return param is not None and bool(param.bool_param)


def _decode_text(arr) -> str:
    if arr is None or arr.size == 0:
        return ""
    value = arr.reshape(-1)[0]
    if isinstance(value, (bytes, bytearray, np.bytes_)):
        return bytes(value).decode("utf-8", errors="replace")
    return str(value)


def _frame_audio(result, i: int) -> np.ndarray:
    """Response i's AUDIO_OUT, checked to be one frame."""
    pcm = result.as_numpy(contract.AUDIO_OUT)
    if pcm is None:
        raise ProtocolError(f"response {i} has no {contract.AUDIO_OUT} output")
    pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
    if pcm.size != contract.FRAME_SAMPLES:
        raise ProtocolError(
            f"response {i}: {contract.AUDIO_OUT} has {pcm.size} samples, expected {contract.FRAME_SAMPLES}"
        )
    return pcm


class AnswerCollector:
    """The answers to one conversation's `n_frames` frames sent to `model_name` at `url`.

    `callback` is the stream's callback: on tritonclient's thread it only timestamps and queues
    each response. The calling thread takes them (`wait_one`, `drain`), so that `on_frame` runs
    and errors are raised there. The stall clock (`last_event`) runs from the last answer, or
    from the send that found no frame outstanding.
    """

    def __init__(self, n_frames: int, url: str, model_name: str, response_timeout_s: float,
                 on_frame: Optional[Callable[[AnsweredFrame], None]] = None):
        self.n_frames, self.url, self.model_name = n_frames, url, model_name
        self.response_timeout_s, self.on_frame = response_timeout_s, on_frame
        self._responses: "queue.Queue[tuple]" = queue.Queue()
        self.audio = np.zeros((n_frames, contract.FRAME_SAMPLES), dtype=np.float32)
        self.text_pieces: list = []
        self.latencies_ms: list = []
        self.send_times = [0.0] * n_frames
        self.sent = self.received = 0
        self.last_event = 0.0
        self.first_send: Optional[float] = None
        self.started_at: Optional[float] = None
        self.last_recv: Optional[float] = None

    def callback(self, result, error) -> None:
        # Runs on tritonclient's stream thread: only timestamp and hand over.
        self._responses.put((time.perf_counter(), result, error))

    def sending(self, i: int) -> None:
        """Frame i goes out now: its send time, and the stall clock's start if none is outstanding."""
        now = time.perf_counter()
        if self.first_send is None:
            self.first_send = now
            self.started_at = time.time() - (time.perf_counter() - now)
            self.last_event = now
        elif self.received == self.sent:
            self.last_event = now
        self.send_times[i] = now

    def was_sent(self, i: int) -> None:
        """Frame i is on the stream: from now on it may be answered."""
        self.sent = i + 1

    def wait_one(self, deadline: float) -> bool:
        """Handle one queued response, waiting until `deadline` at most. False on timeout."""
        remaining = deadline - time.perf_counter()
        try:
            item = self._responses.get(timeout=max(remaining, 0.0)) if remaining > 0 else self._responses.get_nowait()
        except queue.Empty:
            return False
        self._handle(item)
        return True

    def drain(self) -> None:
        """Handle every response queued now, waiting for none."""
        while True:
            try:
                item = self._responses.get_nowait()
            except queue.Empty:
                return
            self._handle(item)

    def check_stall(self, now: float) -> None:
        """StreamTimeoutError if frames are outstanding and nothing came for the timeout."""
        if self.received < self.sent and now - self.last_event > self.response_timeout_s:
            raise StreamTimeoutError(
                f"no response from {self.url} for {self.response_timeout_s:g} s "
                f"({self.received} of {self.sent} frames answered)"
            )

    def wait_until_answered(self, count: int) -> None:
        """Take answers until `count` frames are answered, or raise StreamTimeoutError."""
        while self.received < count:
            if not self.wait_one(self.last_event + self.response_timeout_s):
                self.check_stall(time.perf_counter())

    def result(self, sequence_id: int) -> ConversationResult:
        """The conversation's audio, text and timings, as collected so far."""
        timed = self.last_recv is not None and self.first_send is not None
        return ConversationResult(
            audio=self.audio.reshape(-1),
            text_pieces=self.text_pieces,
            sequence_id=sequence_id,
            frames_sent=self.sent,
            frames_received=self.received,
            first_audio_ms=(self.latencies_ms[0] if self.latencies_ms else None),
            latencies_ms=self.latencies_ms,
            wall_s=(self.last_recv - self.first_send) if timed else 0.0,
            send_offsets_s=[t - self.send_times[0] for t in self.send_times[: self.sent]],
            started_at=self.started_at,
        )

    def _handle(self, item) -> None:
        t_recv, result, error = item
        if error is not None:
            raise self._stream_error(error)
        if len(result.get_response().outputs) == 0:
            # The flag-only final response of a request (enable_empty_final_response).
            if not is_final_response(result):
                raise ProtocolError("the server sent a response without outputs that is not a final response")
            return
        self._take_frame(t_recv, result)

    def _stream_error(self, error) -> StreamError:
        """The StreamError of an error on the stream: the transport's, or the model's answer."""
        msg = error_text(error)
        if is_unavailable(error):
            return ServerUnreachableError(f"Triton at {self.url} is unreachable (stream failed): {msg}")
        if grpc_status(error) is not None:
            return ConnectionLostError(f"the stream to {self.url} broke after {self.received} of {self.n_frames} "
                                       f"frames were answered (the server or the balancer went away): {msg}")
        return ServerError(f"server error (model {self.model_name!r}, frame {self.received}): {msg}")

    def _take_frame(self, t_recv: float, result) -> None:
        i = self.received
        if i >= self.n_frames:
            raise ProtocolError(f"the server sent more responses than the {self.n_frames} frames sent")
        if i >= self.sent:
            raise ProtocolError(f"the server answered frame {i} before it was sent")
        self.audio[i] = _frame_audio(result, i)
        self.text_pieces.append(_decode_text(result.as_numpy(contract.TEXT_OUT)))
        self.latencies_ms.append((t_recv - self.send_times[i]) * 1000.0)
        self.received = i + 1
        self.last_event = self.last_recv = t_recv
        if self.on_frame is not None:
            self.on_frame(AnsweredFrame(i, self.n_frames, self.latencies_ms[-1], self.text_pieces[-1]))
