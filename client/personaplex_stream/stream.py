"""Stream one PersonaPlex conversation to Triton over a gRPC bidirectional stream.

One conversation is one Triton sequence: every 80 ms frame of user audio (1920 samples
of 24 kHz mono float32) is one request on the stream, carrying the sequence id, with
`sequence_start` on the first request and `sequence_end` on the last. The persona
options travel only on the first request. The server answers each request with one
response holding the agent's 80 ms of audio (AUDIO_OUT) and text piece (TEXT_OUT), in
order; with `enable_empty_final_response` a request's last response is flagged final, and
where no frame is left to carry the flag it comes alone, without outputs: skipped here.

Only numpy and tritonclient are imported (and this package's `contract` and `audio`): no
torch, no scipy, no server packages.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from . import contract
from .audio import split_frames

__all__ = [
    "DEFAULT_URL",
    "Persona",
    "ConversationResult",
    "AnsweredFrame",
    "StreamError",
    "ServerUnreachableError",
    "ServerError",
    "ConnectionLostError",
    "StreamTimeoutError",
    "ProtocolError",
    "stream_conversation",
    "new_sequence_id",
    "latency_percentiles",
    "build_persona_inputs",
    "build_request_inputs",
]

DEFAULT_URL = "localhost:8001"
FRAME_SECONDS = contract.FRAME_SAMPLES / contract.SAMPLE_RATE  # 0.08


# ----------------------------------------------------------------------------- errors


class StreamError(RuntimeError):
    """Base class of the errors raised while streaming a conversation."""


class ServerUnreachableError(StreamError):
    """The Triton server could not be reached at the given url."""


class ServerError(StreamError):
    """The server answered with an error (its message is the exception's message)."""


class ConnectionLostError(StreamError):
    """The stream broke mid-conversation: the server (or the balancer before it) went away."""


class StreamTimeoutError(StreamError):
    """The server stopped answering: no response within the timeout."""


class ProtocolError(StreamError):
    """The server's responses do not follow the wire contract."""


# ----------------------------------------------------------------------------- persona


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


def new_sequence_id() -> int:
    """A random nonzero 63-bit sequence id (fits Triton's int64 sequence_id parameter)."""
    while True:
        sid = secrets.randbits(63)
        if sid != 0:
            return sid


# ----------------------------------------------------------------------------- result


def latency_percentiles(latencies_ms: Sequence[float], quantiles: Sequence[float] = (50, 95)) -> tuple:
    """The latencies' percentiles in ms (linear interpolation), p50 and p95 unless `quantiles`
    says otherwise; a None for each if there are none."""
    if len(latencies_ms) == 0:
        return (None,) * len(quantiles)
    return tuple(float(v) for v in np.percentile(np.asarray(latencies_ms, dtype=np.float64), quantiles))


@dataclass
class ConversationResult:
    """What came back from one conversation.

    audio: the agent's audio, float32 24 kHz mono, the frames concatenated
    (frames_received * 1920 samples, which is frames_sent * 1920 on success).
    text_pieces: the TEXT_OUT piece of each frame ("" where the agent said nothing).
    latencies_ms: per frame, receive time of response i minus send time of frame i.
    first_audio_ms: time from the first send to the first response.
    wall_s: time from the first send to the last response.
    send_offsets_s: per frame, its send time after the first frame's.
    started_at: wall-clock time (time.time()) of the first send, to line frames up with
    server-side traces.
    """

    audio: np.ndarray
    text_pieces: list
    sequence_id: int
    frames_sent: int
    frames_received: int
    first_audio_ms: Optional[float]
    latencies_ms: list = field(default_factory=list)
    wall_s: float = 0.0
    send_offsets_s: list = field(default_factory=list)
    started_at: Optional[float] = None

    @property
    def text(self) -> str:
        """The transcript of the agent: the text pieces joined."""
        return "".join(self.text_pieces)

    @property
    def latency_ms_p50(self) -> Optional[float]:
        return latency_percentiles(self.latencies_ms)[0]

    @property
    def latency_ms_p95(self) -> Optional[float]:
        return latency_percentiles(self.latencies_ms)[1]

    @property
    def audio_seconds(self) -> float:
        return self.audio.size / contract.SAMPLE_RATE

    @property
    def real_time_factor(self) -> Optional[float]:
        """Time to answer the whole input over its duration: for a paced stream about 1 when
        the server keeps pace with the speaker and above 1 when it falls behind; unpaced, below 1
        when the server is faster than real time."""
        return self.wall_s / self.audio_seconds if self.frames_received else None

    def summary(self) -> dict:
        """JSON-ready figures of the conversation (floats rounded, None where unknown)."""

        def r(x, nd=2):
            return None if x is None else round(float(x), nd)

        p50, p95 = latency_percentiles(self.latencies_ms)
        return {
            "sequence_id": self.sequence_id,
            "frames_sent": self.frames_sent,
            "frames_received": self.frames_received,
            "audio_seconds": r(self.audio_seconds, 3),
            "wall_s": r(self.wall_s, 3),
            "real_time_factor": r(self.real_time_factor, 3),
            "first_audio_ms": r(self.first_audio_ms),
            "latency_ms_p50": r(p50),
            "latency_ms_p95": r(p95),
            "latency_ms_max": r(max(self.latencies_ms)) if self.latencies_ms else None,
            "text": self.text,
        }


@dataclass(frozen=True)
class AnsweredFrame:
    """One frame's answer as it arrives: its index (from 0) of `total`, its latency (send to
    answer) and the agent's text piece for it ("" mostly)."""

    index: int
    total: int
    latency_ms: float
    text: str


# ----------------------------------------------------------------------------- streaming


def _strip_scheme(url: str) -> str:
    for scheme in ("grpc://", "http://", "https://"):
        if url.startswith(scheme):
            return url[len(scheme) :]
    return url


def _error_text(error) -> str:
    if isinstance(error, InferenceServerException):
        return error.message() or str(error)
    return str(error)


def _grpc_status(error):
    """The gRPC status of a transport error; None for an error the model sent in a response."""
    return error.status() if isinstance(error, InferenceServerException) else None


def _is_unavailable(error) -> bool:
    status = _grpc_status(error)
    return status is not None and "UNAVAILABLE" in str(status)


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


def stream_conversation(
    audio: np.ndarray,
    url: str = DEFAULT_URL,
    model_name: str = contract.MODEL_NAME,
    persona: Optional[Persona] = None,
    *,
    sequence_id: Optional[int] = None,
    realtime: bool = False,
    max_in_flight: int = 8,
    response_timeout_s: float = 60.0,
    connect_timeout_s: float = 10.0,
    check_ready: bool = True,
    on_frame: Optional[Callable[[AnsweredFrame], None]] = None,
) -> ConversationResult:
    """Run one conversation: stream `audio` frame by frame and collect the agent's answer.

    audio: float32 mono at 24 kHz (read other files with `personaplex_stream.audio.read_wav`);
        it is cut into 1920-sample frames, the last one zero-padded.
    url: Triton's gRPC endpoint "host:port". model_name: the model to call ("ensemble").
    persona: options sent on the first request only; None sends none.
    sequence_id: the Triton sequence id; a random nonzero 63-bit id when None.
    realtime: pace the sends at one frame per 80 ms on an absolute schedule (as a live
        microphone would), regardless of how fast the server answers. Otherwise send as
        fast as the server answers, with at most `max_in_flight` frames unanswered.
    response_timeout_s: raise StreamTimeoutError when frames are outstanding and no
        response came for this long.
    connect_timeout_s: deadline of the liveness / readiness check made before streaming
        (skipped when `check_ready` is False).
    on_frame: called with each frame's AnsweredFrame as it arrives, on the calling thread.

    Raises ServerUnreachableError, ServerError (with the server's message),
    StreamTimeoutError, ProtocolError, or ValueError for empty audio. The stream is
    stopped and the client closed in every case.
    """
    frames = split_frames(np.asarray(audio, dtype=np.float32).reshape(-1), contract.FRAME_SAMPLES)
    n = frames.shape[0]
    if n == 0:
        raise ValueError("no audio to stream (0 samples)")
    if max_in_flight < 1:
        raise ValueError("max_in_flight must be at least 1")
    if sequence_id is None:
        sequence_id = new_sequence_id()
    if not (0 < int(sequence_id) < 2**63):
        raise ValueError("sequence_id must be in [1, 2**63)")
    sequence_id = int(sequence_id)
    url = _strip_scheme(url)

    responses: "queue.Queue[tuple]" = queue.Queue()

    def callback(result, error):
        # Runs on tritonclient's stream thread: only timestamp and hand over.
        responses.put((time.perf_counter(), result, error))

    try:
        client = grpcclient.InferenceServerClient(url=url)
    except InferenceServerException as exc:
        raise ServerUnreachableError(f"cannot connect to Triton at {url}: {_error_text(exc)}") from None

    outputs = [grpcclient.InferRequestedOutput(contract.AUDIO_OUT), grpcclient.InferRequestedOutput(contract.TEXT_OUT)]
    send_times = [0.0] * n
    latencies_ms: list = []
    audio_out = np.zeros((n, contract.FRAME_SAMPLES), dtype=np.float32)
    text_pieces: list = []
    state = {"received": 0, "last_event": 0.0}
    first_send = None
    started_at = None
    last_recv = None
    ok = False
    stream_started = False

    def handle(item) -> None:
        nonlocal last_recv
        t_recv, result, error = item
        if error is not None:
            msg = _error_text(error)
            if _is_unavailable(error):
                raise ServerUnreachableError(f"Triton at {url} is unreachable (stream failed): {msg}")
            if _grpc_status(error) is not None:
                raise ConnectionLostError(f"the stream to {url} broke after {state['received']} of {n} frames "
                                          f"were answered (the server or the balancer went away): {msg}")
            raise ServerError(f"server error (model {model_name!r}, frame {state['received']}): {msg}")
        response = result.get_response()
        if len(response.outputs) == 0:
            # The flag-only final response of a request (enable_empty_final_response).
            if not is_final_response(result):
                raise ProtocolError("the server sent a response without outputs that is not a final response")
            return
        i = state["received"]
        if i >= n:
            raise ProtocolError(f"the server sent more responses than the {n} frames sent")
        if i >= sent:
            raise ProtocolError(f"the server answered frame {i} before it was sent")
        pcm = result.as_numpy(contract.AUDIO_OUT)
        if pcm is None:
            raise ProtocolError(f"response {i} has no {contract.AUDIO_OUT} output")
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        if pcm.size != contract.FRAME_SAMPLES:
            raise ProtocolError(
                f"response {i}: {contract.AUDIO_OUT} has {pcm.size} samples, expected {contract.FRAME_SAMPLES}"
            )
        audio_out[i] = pcm
        text_pieces.append(_decode_text(result.as_numpy(contract.TEXT_OUT)))
        latencies_ms.append((t_recv - send_times[i]) * 1000.0)
        state["received"] = i + 1
        state["last_event"] = t_recv
        last_recv = t_recv
        if on_frame is not None:
            on_frame(AnsweredFrame(i, n, latencies_ms[-1], text_pieces[-1]))

    def wait_one(deadline: float) -> bool:
        """Handle one queued response, waiting until `deadline` at most. False on timeout."""
        remaining = deadline - time.perf_counter()
        try:
            item = responses.get(timeout=max(remaining, 0.0)) if remaining > 0 else responses.get_nowait()
        except queue.Empty:
            return False
        handle(item)
        return True

    def drain() -> None:
        while True:
            try:
                item = responses.get_nowait()
            except queue.Empty:
                return
            handle(item)

    def check_stall(now: float) -> None:
        if state["received"] < sent and now - state["last_event"] > response_timeout_s:
            raise StreamTimeoutError(
                f"no response from {url} for {response_timeout_s:g} s "
                f"({state['received']} of {sent} frames answered)"
            )

    sent = 0
    try:
        if check_ready:
            try:
                live = client.is_server_live(client_timeout=connect_timeout_s)
            except InferenceServerException as exc:
                raise ServerUnreachableError(f"cannot reach Triton at {url}: {_error_text(exc)}") from None
            if not live:
                raise ServerUnreachableError(f"Triton at {url} reports it is not live")
            try:
                ready = client.is_model_ready(model_name, client_timeout=connect_timeout_s)
            except InferenceServerException as exc:
                raise ServerError(f"cannot query model {model_name!r} at {url}: {_error_text(exc)}") from None
            if not ready:
                raise ServerError(f"model {model_name!r} is not ready on Triton at {url}")

        try:
            client.start_stream(callback=callback)
        except InferenceServerException as exc:
            raise ServerUnreachableError(f"cannot open a stream to Triton at {url}: {_error_text(exc)}") from None
        stream_started = True

        schedule_start = time.perf_counter()
        for i in range(n):
            if realtime:
                target = schedule_start + i * FRAME_SECONDS
                while True:
                    now = time.perf_counter()
                    check_stall(now)
                    if now >= target:
                        break
                    wait_one(min(target, now + 0.05))
            else:
                while i - state["received"] >= max_in_flight:
                    if not wait_one(state["last_event"] + response_timeout_s):
                        check_stall(time.perf_counter())
            inputs = build_request_inputs(frames[i], persona, first=(i == 0))
            now = time.perf_counter()
            if first_send is None:
                first_send = now
                started_at = time.time() - (time.perf_counter() - now)
                state["last_event"] = now
            elif state["received"] == sent:
                # Nothing was outstanding: the stall clock starts with this frame.
                state["last_event"] = now
            send_times[i] = now
            try:
                client.async_stream_infer(
                    model_name,
                    inputs,
                    outputs=outputs,
                    sequence_id=sequence_id,
                    sequence_start=(i == 0),
                    sequence_end=(i == n - 1),
                    enable_empty_final_response=True,
                )
            except InferenceServerException as exc:
                # The stream broke; its reason usually waits in the queue.
                drain()
                raise ServerError(f"cannot send frame {i} to {url}: {_error_text(exc)}") from None
            sent = i + 1
            drain()

        while state["received"] < n:
            if not wait_one(state["last_event"] + response_timeout_s):
                check_stall(time.perf_counter())
        ok = True
    finally:
        if stream_started:
            _stop_stream(client, graceful=ok)
        try:
            client.close()
        except Exception:
            pass

    return ConversationResult(
        audio=audio_out.reshape(-1),
        text_pieces=text_pieces,
        sequence_id=sequence_id,
        frames_sent=sent,
        frames_received=state["received"],
        first_audio_ms=(latencies_ms[0] if latencies_ms else None),
        latencies_ms=latencies_ms,
        wall_s=(last_recv - first_send) if (last_recv is not None and first_send is not None) else 0.0,
        send_offsets_s=[t - send_times[0] for t in send_times[:sent]],
        started_at=started_at,
    )


def _stop_stream(client, graceful: bool, grace_s: float = 5.0) -> None:
    """Stop the client's stream: gracefully (let the server finish) when `graceful`, and
    by cancelling it otherwise or when the graceful stop takes more than `grace_s`."""
    if graceful:
        stopper = threading.Thread(target=_quiet_stop, args=(client, False), daemon=True)
        stopper.start()
        stopper.join(grace_s)
        if not stopper.is_alive():
            return
    _quiet_stop(client, True)


def _quiet_stop(client, cancel: bool) -> None:
    try:
        client.stop_stream(cancel_requests=cancel)
    except Exception:
        pass
