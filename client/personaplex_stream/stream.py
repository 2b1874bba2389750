"""Stream one PersonaPlex conversation to Triton over a gRPC bidirectional stream.

One conversation is one Triton sequence: every 80 ms frame of user audio (1920 samples of
24 kHz mono float32) is one request on the stream, carrying the sequence id, with
`sequence_start` on the first request and `sequence_end` on the last; the persona travels on
the first only (`request`). The stream is opened in `connection`, the sends paced in `pacing`,
the answers collected in `answers`, and the figures reported in `report`.

Only numpy and tritonclient are imported (and this package's modules): no torch, no scipy,
no server packages.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
from tritonclient.utils import InferenceServerException

from . import contract
from .answers import AnswerCollector, AnsweredFrame
from .audio import split_frames
from .connection import DEFAULT_URL, open_stream, stop_stream, strip_scheme
from .errors import ServerError, error_text
from .pacing import RealtimePacing, WindowPacing
from .report import ConversationResult
from .request import Persona, build_end_inputs, build_request_inputs, checked_sequence_id, requested_outputs


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

    audio: float32 mono at 24 kHz (read other files with `personaplex_stream.audio.read_wav`),
        cut into 1920-sample frames, the last one zero-padded. url: Triton's gRPC endpoint
        "host:port". model_name: the model to call. persona: sent on the first request only.
    sequence_id: the Triton sequence id; a random nonzero 63-bit id when None.
    realtime: one frame per 80 ms on an absolute schedule, as a live microphone would, however
        fast the server answers; otherwise as fast as it answers, at most `max_in_flight` unanswered.
    response_timeout_s: StreamTimeoutError when frames are outstanding and nothing came this long.
    connect_timeout_s: deadline of the liveness / readiness check (none if not `check_ready`).
    on_frame: called with each frame's AnsweredFrame as it arrives, on the calling thread.

    Raises ServerUnreachableError, ServerError (with the server's message), ConnectionLostError,
    StreamTimeoutError, ProtocolError, or ValueError for bad arguments; the stream is stopped and
    the client closed in every case.
    """
    frames = split_frames(np.asarray(audio, dtype=np.float32).reshape(-1), contract.FRAME_SAMPLES)
    if frames.shape[0] == 0:
        raise ValueError("no audio to stream (0 samples)")
    if max_in_flight < 1:
        raise ValueError("max_in_flight must be at least 1")
    sequence_id = checked_sequence_id(sequence_id)
    url = strip_scheme(url)
    answers = AnswerCollector(frames.shape[0], url, model_name, response_timeout_s, on_frame)
    with open_stream(url, model_name, answers.callback, check_ready=check_ready,
                     connect_timeout_s=connect_timeout_s) as client:
        pacing = RealtimePacing(answers) if realtime else WindowPacing(answers, max_in_flight)
        try:
            _send_frames(client, frames, persona, model_name, sequence_id, answers, pacing)
            answers.wait_until_answered(frames.shape[0])
        except BaseException:  # Ctrl-C too
            _end_early(client, model_name, sequence_id, answers)
            raise
    return answers.result(sequence_id)


def _end_early(client, model_name: str, sequence_id: int, answers: AnswerCollector) -> None:
    """The conversation failed or was interrupted after its start went out and before its end
    did: send the end, without audio, and let the stream finish (within connection.STOP_GRACE_S),
    so that the server frees its slot and Triton its sequence now, not at their idle timeouts."""
    if not 0 < answers.sent < answers.n_frames:
        return
    try:
        client.async_stream_infer(model_name, build_end_inputs(), sequence_id=sequence_id,
                                  sequence_start=False, sequence_end=True, enable_empty_final_response=True)
    except Exception:
        return  # the stream is gone: the server's idle timeouts free what it held
    stop_stream(client, graceful=True)


def _send_frames(client, frames: np.ndarray, persona: Optional[Persona], model_name: str, sequence_id: int,
                 answers: AnswerCollector, pacing: RealtimePacing | WindowPacing) -> None:
    """Send every frame on the stream in its turn, taking the answers that came after each."""
    outputs = requested_outputs()
    last = frames.shape[0] - 1
    for i, frame in enumerate(frames):
        pacing.wait_for_turn(i)
        inputs = build_request_inputs(frame, persona, first=(i == 0))
        answers.sending(i)
        try:
            client.async_stream_infer(model_name, inputs, outputs=outputs, sequence_id=sequence_id,
                                      sequence_start=(i == 0), sequence_end=(i == last),
                                      enable_empty_final_response=True)
        except InferenceServerException as exc:
            answers.drain()  # the stream broke; its reason usually waits in the queue
            raise ServerError(f"cannot send frame {i} to {answers.url}: {error_text(exc)}") from None
        answers.was_sent(i)
        answers.drain()
