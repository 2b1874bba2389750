"""Unit tests of the client's answer collection and pacing, with tritonclient's own response
type (`InferResult` over a `ModelInferResponse`, as its stream thread hands them over) and its
own exception, and no server: the order and timing of answers, what breaks the contract, and
the two pacings' schedules and stall timeouts. Streaming itself is tested against a real
tritonserver in test_integration.py and test_faults.py."""

import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from personaplex_stream import (
    ConnectionLostError,
    ProtocolError,
    ServerError,
    ServerUnreachableError,
    StreamTimeoutError,
    contract,
)
from personaplex_stream.answers import AnswerCollector
from personaplex_stream.pacing import FRAME_SECONDS, RealtimePacing, WindowPacing

N = contract.FRAME_SAMPLES
URL = "127.0.0.1:1"


def _response(samples=None, text=b"", final=False) -> grpcclient.InferResult:
    """A streamed response as the server sends it: one frame's outputs, or none (flag-only)."""
    response = service_pb2.ModelInferResponse(model_name=contract.MODEL_NAME)
    if samples is not None:
        pcm = np.asarray(samples, dtype=np.float32)
        response.outputs.add(name=contract.AUDIO_OUT, datatype="FP32", shape=[pcm.size])
        response.raw_output_contents.append(pcm.tobytes())
        response.outputs.add(name=contract.TEXT_OUT, datatype="BYTES", shape=[1])
        response.raw_output_contents.append(serialize_byte_tensor(np.array([text], dtype=object)).item())
    if final:
        response.parameters["triton_final_response"].bool_param = True
    return grpcclient.InferResult(response)


def _collector(n_frames, timeout_s=60.0, on_frame=None, sent=0) -> AnswerCollector:
    answers = AnswerCollector(n_frames, URL, contract.MODEL_NAME, timeout_s, on_frame)
    for i in range(sent):
        answers.sending(i)
        answers.was_sent(i)
    return answers


def test_answers_are_taken_in_order_timed_and_reported():
    seen = []
    answers = _collector(2, on_frame=seen.append, sent=2)
    answers.callback(_response(np.full(N, 0.25), "Hel".encode()), None)
    answers.callback(_response(np.full(N, -0.5), b"lo", final=True), None)
    answers.callback(_response(final=True), None)  # a flag-only final: skipped
    answers.wait_until_answered(2)
    answers.drain()
    result = answers.result(sequence_id=9)
    assert (result.frames_sent, result.frames_received, result.text, result.sequence_id) == (2, 2, "Hello", 9)
    assert result.audio.shape == (2 * N,) and result.audio[0] == 0.25 and result.audio[-1] == -0.5
    assert [f.index for f in seen] == [0, 1] and all(f.total == 2 for f in seen)
    assert [f.latency_ms for f in seen] == result.latencies_ms and all(ms >= 0 for ms in result.latencies_ms)
    assert result.first_audio_ms == result.latencies_ms[0] and result.wall_s > 0
    assert result.send_offsets_s[0] == 0 and result.send_offsets_s[1] >= 0


@pytest.mark.parametrize("response, sent, message", [
    (_response(np.zeros(N - 1)), 1, "has 1919 samples, expected 1920"),
    (_response(np.zeros(N)), 0, "answered frame 0 before it was sent"),
    (_response(), 1, "without outputs that is not a final response"),
])
def test_answers_that_break_the_contract_are_named(response, sent, message):
    answers = _collector(1, sent=sent)
    answers.callback(response, None)
    with pytest.raises(ProtocolError, match=message):
        answers.drain()


def test_one_answer_more_than_the_frames_sent_is_a_protocol_error():
    answers = _collector(1, sent=1)
    answers.callback(_response(np.zeros(N)), None)
    answers.callback(_response(np.zeros(N)), None)
    with pytest.raises(ProtocolError, match="more responses than the 1 frames sent"):
        answers.drain()
    assert answers.received == 1


@pytest.mark.parametrize("error, raised, message", [
    (InferenceServerException(msg="bad voice 'XYZ'"), ServerError, "model 'ensemble', frame 0\\): bad voice 'XYZ'"),
    (InferenceServerException(msg="Socket closed", status="StatusCode.UNAVAILABLE"), ServerUnreachableError,
     "unreachable \\(stream failed\\): Socket closed"),
    (InferenceServerException(msg="RST_STREAM", status="StatusCode.INTERNAL"), ConnectionLostError,
     "broke after 0 of 3 frames were answered"),
])
def test_an_error_on_the_stream_is_told_by_its_kind(error, raised, message):
    answers = _collector(3, sent=1)
    answers.callback(None, error)
    with pytest.raises(raised, match=message):
        answers.drain()


def test_realtime_pacing_keeps_an_absolute_schedule():
    """Frame i goes out at start + i * 80 ms, never before: a send that came late (a slow tick of
    the caller, here until 280 ms) does not push the later frames back, as it would on a schedule
    relative to the last send (there: frames 2, 3, 4 at 360, 440, 520 ms)."""
    answers = _collector(5)
    pacing = RealtimePacing(answers)
    turns = []
    for i in range(5):
        pacing.wait_for_turn(i)
        turns.append(time.perf_counter() - pacing.start)
        if i == 1:
            time.sleep(2.5 * FRAME_SECONDS)  # frames 2 and 3 fall due meanwhile
    assert all(turn >= i * FRAME_SECONDS for i, turn in enumerate(turns))
    slack = 0.05  # for a loaded machine's late wake-ups
    assert turns[2] < 3.5 * FRAME_SECONDS + slack and turns[3] < 3.5 * FRAME_SECONDS + slack  # at once
    assert turns[4] < 4 * FRAME_SECONDS + slack


def test_realtime_pacing_stops_on_a_stall():
    answers = _collector(20, timeout_s=0.2, sent=1)  # frame 0 out, never answered
    pacing = RealtimePacing(answers)
    t0 = time.perf_counter()
    with pytest.raises(StreamTimeoutError, match="0 of 1 frames answered"):
        pacing.wait_for_turn(19)  # due in 1.5 s
    assert 0.2 <= time.perf_counter() - t0 < 0.5


def test_window_pacing_waits_for_room_then_stalls():
    answers = _collector(5, timeout_s=0.2, sent=2)
    pacing = WindowPacing(answers, max_in_flight=3)
    pacing.wait_for_turn(2)  # two unanswered, room for a third
    answers.sending(2)
    answers.was_sent(2)
    answers.callback(_response(np.zeros(N)), None)
    pacing.wait_for_turn(3)  # frame 0's answer made room
    assert answers.received == 1
    answers.sending(3)
    answers.was_sent(3)
    t0 = time.perf_counter()
    with pytest.raises(StreamTimeoutError, match="1 of 4 frames answered"):
        pacing.wait_for_turn(4)  # three unanswered: no room, and no answer comes
    assert time.perf_counter() - t0 < 0.5
