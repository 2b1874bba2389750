"""Both stages in one process (serving/speech.py): a request's answers gathered from the two
stages, and the service, in two engines and in one tick, against the stages stepped by hand."""

import threading

import numpy as np
import pytest

from personaplex_triton.core import audio, contract
from personaplex_triton.serving.speech import RequestAnswers, SpeechService


class Client:
    """What a request's send and finish were called with, in order."""

    def __init__(self):
        self.calls = []
        self.done = threading.Event()

    def send(self, outputs, last):
        assert not self.done.is_set(), "a send after the request finished"
        self.calls.append(("audio", outputs["n"], last))

    def finish(self, error):
        assert not self.done.is_set(), "finished twice"
        self.calls.append(("finish", error))
        self.done.set()


def test_the_request_finishes_once_code2wav_has_answered_every_frame():
    client = Client()
    answers = RequestAnswers(client.send, client.finish)
    assert answers.frame_to_code2wav() and answers.frame_to_code2wav()
    answers.talker_done(None)  # the talker is done before code2wav has answered
    assert not client.done.is_set()
    answers.audio({"n": 0}, False)
    answers.code2wav_done(None)
    answers.audio({"n": 1}, True)
    assert not client.done.is_set()
    answers.code2wav_done(None)
    assert client.calls == [("audio", 0, False), ("audio", 1, True), ("finish", None)]


def test_a_talker_error_comes_after_the_audio_of_the_frames_before_it():
    client = Client()
    answers = RequestAnswers(client.send, client.finish)
    assert answers.frame_to_code2wav()
    answers.talker_done("conversation 5: the step failed")
    answers.audio({"n": 0}, False)
    answers.code2wav_done(None)
    assert client.calls == [("audio", 0, False), ("finish", "conversation 5: the step failed")]


def test_a_code2wav_error_ends_the_request_once_and_drops_the_frames_after_it():
    client = Client()
    answers = RequestAnswers(client.send, client.finish)
    assert answers.frame_to_code2wav() and answers.frame_to_code2wav()
    answers.code2wav_done("frame 3 of conversation 5 was lost")
    assert client.calls == [("finish", "code2wav: frame 3 of conversation 5 was lost")]  # before the talker is done
    answers.audio({"n": 1}, False)         # the other frame's audio: dropped
    answers.code2wav_done(None)
    assert not answers.frame_to_code2wav()  # the talker's later frames are not sent on
    answers.talker_done(None)
    assert len(client.calls) == 1


@pytest.fixture(scope="module")
def speech(tiny_checkpoint):
    service = SpeechService(str(tiny_checkpoint), max_conversations=2, decoder_conversations=4, warm_personas="",
                            start_piece_spacing=3, one_tick=False)
    yield service
    service.close()


def test_the_talkers_starts_are_spaced_as_configured(speech):
    """`start_piece_spacing` reaches the talker's scheduler; code2wav prefills in one chunk."""
    assert speech.talker.engine.scheduler.chunk_spacing_ticks == 3
    assert speech.code2wav.engine.scheduler.chunk_spacing_ticks == 1


def converse(service, conversation, pcm, arrays, frames_a_request=3):
    """`pcm` through `service`, a few frames a request: its (audio, text pieces, errors)."""
    frames = audio.split_frames(pcm)
    pieces, texts, errors = [], [], []
    for first in range(0, len(frames), frames_a_request):
        chunk = frames[first:first + frames_a_request]
        done = threading.Event()
        inputs = {contract.AUDIO_IN: chunk.reshape(-1), **(arrays if first == 0 else {})}

        def send(outputs, _last):
            pieces.append(outputs[contract.AUDIO_OUT])
            texts.append(outputs[contract.TEXT_OUT][0].decode())

        service.handle(conversation, first == 0, first + len(chunk) == len(frames), inputs, send,
                       lambda error, d=done: (errors.append(error), d.set()))
        assert done.wait(120)
    return np.concatenate(pieces), texts, errors


@pytest.mark.parametrize("service", ["speech", "one_tick"])
def test_the_service_answers_what_the_stages_compute(service, request):
    """Every frame, in order, is what the talker and code2wav give when stepped by hand: with two
    engines, and in one tick (`one_tick`: one engine whose tick steps the talker, then decodes)."""
    from personaplex_triton.lm.sampling import SamplingParams
    from personaplex_triton.stages.code2wav import CodesFrame
    from personaplex_triton.stages.talker import TalkerSetup

    service = request.getfixturevalue(service)
    pcm = np.random.default_rng(3).uniform(-0.3, 0.3, 7 * contract.FRAME_SAMPLES).astype(np.float32)
    arrays = {contract.VOICE: np.array([b"NATF0"], np.object_), contract.SEED: np.array([42], np.int64)}
    got_audio, got_text, errors = converse(service, 5, pcm, arrays)
    assert errors == [None, None, None] and len(got_text) == 7

    stage = service.talker.talker
    talker, decoder = (stage.talker, stage.code2wav) if service.one_tick else (stage, service.code2wav.decoder)
    talker.prefill(0, TalkerSetup(service.talker.personas.persona("NATF0", ""), SamplingParams(seed=42)))
    decoder.prefill(0)
    expected_audio, expected_text = [], []
    try:
        for frame in audio.split_frames(pcm):
            step = talker.tick({0: frame})[0]
            expected_audio.append(decoder.tick({0: CodesFrame(step.codes)})[0])
            expected_text.append(talker.text_piece(step.text_token))
    finally:
        talker.stop(0)
    assert got_text == expected_text
    np.testing.assert_allclose(got_audio, np.concatenate(expected_audio), atol=1e-5)


def test_a_bad_request_gets_its_error_and_no_audio(speech):
    errors, sent = [], []
    speech.handle(6, True, True, {contract.AUDIO_IN: np.zeros(100, np.float32)},
                  lambda outputs, last: sent.append(last), errors.append)
    assert sent == [] and len(errors) == 1 and "whole number of 1920-sample frames" in errors[0]
    speech.handle(7, False, True, {contract.AUDIO_IN: np.zeros(contract.FRAME_SAMPLES, np.float32)},
                  lambda outputs, last: sent.append(last), errors.append)
    assert sent == [] and "conversation 7 is not open" in errors[1]


@pytest.fixture(scope="module")
def one_tick(tiny_checkpoint):
    service = SpeechService(str(tiny_checkpoint), max_conversations=2, decoder_conversations=4, warm_personas="",
                            one_tick=True)
    yield service
    service.close()


def test_one_tick_has_one_engine_whose_pool_is_the_smaller_stages(one_tick):
    assert one_tick.code2wav is None and one_tick.talker.engine.stage.num_slots == 2  # the talker's 2, not code2wav's 4


def test_one_tick_ends_a_conversation_with_an_empty_end_request(one_tick):
    """An end request without frames finishes after the frames before it, with no response of
    its own (no later stage to tell), and frees the conversation's slot: more conversations
    than the pool's 2 start one after another."""
    for conversation in (11, 12, 13):
        calls, done = [], threading.Event()
        one_tick.handle(conversation, True, False, {contract.AUDIO_IN: np.zeros(2 * contract.FRAME_SAMPLES, np.float32),
                                                    contract.VOICE: np.array([b"NATF0"], np.object_)},
                        lambda outputs, last: calls.append(("audio", outputs[contract.AUDIO_OUT].shape, last)),
                        lambda error: calls.append(("finish", error)))
        one_tick.handle(conversation, False, True, {contract.AUDIO_IN: np.zeros(0, np.float32)},
                        lambda outputs, last: calls.append(("end audio", last)),
                        lambda error: (calls.append(("end", error)), done.set()))
        assert done.wait(60)
        assert calls == [("audio", (contract.FRAME_SAMPLES,), False), ("audio", (contract.FRAME_SAMPLES,), True),
                         ("finish", None), ("end", None)]


def test_one_tick_in_a_process_of_its_own_traces_both_stages(tiny_checkpoint, tmp_path, monkeypatch):
    """With `stage_process`, both stages tick in one child process; the frame trace reads as the
    two stages' (core/trace.py): the talker's tick up to the split, code2wav's after it, in
    order, for every frame answered."""
    from personaplex_triton.core import trace
    from personaplex_triton.core.metrics import Metrics

    class Heartbeats(Metrics):
        def __init__(self):
            self.up = []

        def alive(self, up):
            self.up.append(up)

    monkeypatch.setenv(trace.TRACE_DIR_ENV, str(tmp_path))
    code2wav_metrics = Heartbeats()
    service = SpeechService(str(tiny_checkpoint), max_conversations=2, warm_personas="", one_tick=True,
                            stage_process=True, code2wav_metrics=code2wav_metrics)
    try:
        pcm = np.random.default_rng(5).uniform(-0.3, 0.3, 4 * contract.FRAME_SAMPLES).astype(np.float32)
        _, texts, errors = converse(service, 8, pcm, {contract.VOICE: np.array([b"NATF0"], np.object_)})
        assert errors == [None, None] and len(texts) == 4
        assert any(line.startswith("code2wav: Mimi decoder on") for line in service.load_log_lines())
    finally:
        service.close()
    talker = {r["index"]: r for r in trace.read(tmp_path, "talker") if r["conversation"] == 8}
    code2wav = {r["index"]: r for r in trace.read(tmp_path, "code2wav") if r["conversation"] == 8}
    assert sorted(talker) == sorted(code2wav) == [0, 1, 2, 3]
    for index, spoke in talker.items():
        decoded = code2wav[index]
        assert spoke["tick_start"] <= spoke["tick_end"] == spoke["sent"] == decoded["queued"] == decoded["tick_start"]
        assert decoded["tick_start"] <= decoded["tick_end"] <= decoded["sent"]
    assert code2wav_metrics.up[0] is True and code2wav_metrics.up[-1] is False  # the engine's heartbeat, then its end


def test_the_one_tick_parameter_is_true_or_false():
    from personaplex_triton.serving.stage_builds import one_tick

    assert one_tick({}) is True and one_tick({"one_tick": " False "}) is False
    with pytest.raises(ValueError, match='one_tick must be "true" or "false", got \'yes\''):
        one_tick({"one_tick": "yes"})


def test_a_failed_decode_is_tried_again_and_never_steps_the_talker_twice(tiny_checkpoint):
    """A decode that fails once is tried again within the tick; one that fails twice raises
    StepNotRepeatable, so the engine ends the conversations rather than step the talker again."""
    from personaplex_triton.core import loaders
    from personaplex_triton.core.errors import StepNotRepeatable
    from personaplex_triton.lm.sampling import SamplingParams
    from personaplex_triton.serving.stage_builds import build_speech
    from personaplex_triton.stages.persona import PersonaLibrary
    from personaplex_triton.stages.talker import TalkerSetup

    stage, _ = build_speech(str(tiny_checkpoint), 2, 2, "cpu", 0, "auto", "", "auto", "auto", emit=lambda *_: None)
    calls = {"talker": 0, "decode": 0}
    step, decode = stage.talker.tick, stage.code2wav.tick
    failures = []

    def counted_step(frames):
        calls["talker"] += 1
        return step(frames)

    def failing_decode(frames):
        calls["decode"] += 1
        if failures:
            raise failures.pop(0)
        return decode(frames)

    stage.talker.tick, stage.code2wav.tick = counted_step, failing_decode
    try:
        persona = PersonaLibrary(loaders.resolve_checkpoint(str(tiny_checkpoint)), stage.talker.tokenizer).persona(
            "NATF0", "")
        assert stage.prefill_many({0: TalkerSetup(persona, SamplingParams(seed=1))}) == {}
        frame = np.zeros(contract.FRAME_SAMPLES, np.float32)
        failures[:] = [RuntimeError("once")]
        out = stage.tick({0: frame})
        assert out[0].pcm.shape == (contract.FRAME_SAMPLES,) and calls == {"talker": 1, "decode": 2}
        failures[:] = [RuntimeError("first"), RuntimeError("second")]
        with pytest.raises(StepNotRepeatable, match="RuntimeError: second") as raised:
            stage.tick({0: frame})
        assert not raised.value.out_of_memory and calls == {"talker": 2, "decode": 4}
    finally:
        stage.close()
