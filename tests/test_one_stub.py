"""Both stages in one stub (serving/one_stub.py): one engine's tick steps the talker, then
decodes its frames; the service's answers against the stages stepped by hand."""

import threading

import numpy as np
import pytest

from personaplex_triton.core import audio, contract
from personaplex_triton.serving.one_stub import OneStubService
from personaplex_triton.serving.parameters import SpeechConfig


def config(checkpoint, **values) -> SpeechConfig:
    return SpeechConfig(**{"checkpoint": str(checkpoint), "max_conversations": 2, "code2wav_conversations": 4,
                           "device": "cpu", "warm_personas": (), **values})


@pytest.fixture(scope="module")
def one_stub(tiny_checkpoint):
    service = OneStubService(config(tiny_checkpoint, prefill_chunk_spacing=3))
    yield service
    service.close()


def test_the_prefill_chunks_are_spaced_as_configured(one_stub):
    """`prefill_chunk_spacing` reaches the one engine's scheduler."""
    assert one_stub.engine.scheduler.chunk_spacing_ticks == 3


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


def test_the_service_answers_what_the_stages_compute(one_stub):
    """Every frame, in order, is what the talker and code2wav give when stepped by hand."""
    from personaplex_triton.lm.sampling import SamplingParams
    from personaplex_triton.stages.code2wav import CodesFrame
    from personaplex_triton.stages.talker import TalkerSetup

    service = one_stub
    pcm = np.random.default_rng(3).uniform(-0.3, 0.3, 7 * contract.FRAME_SAMPLES).astype(np.float32)
    arrays = {contract.VOICE: np.array([b"NATF0"], np.object_), contract.SEED: np.array([42], np.int64)}
    got_audio, got_text, errors = converse(service, 5, pcm, arrays)
    assert errors == [None, None, None] and len(got_text) == 7

    talker, decoder = service.talker.talker, service.talker.code2wav  # the one stage's two
    talker.prefill(0, TalkerSetup(service.personas.persona("NATF0", ""), SamplingParams(seed=42)))
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


def test_a_bad_request_gets_its_error_and_no_audio(one_stub):
    errors, sent = [], []
    one_stub.handle(6, True, True, {contract.AUDIO_IN: np.zeros(100, np.float32)},
                  lambda outputs, last: sent.append(last), errors.append)
    assert sent == [] and len(errors) == 1 and "whole number of 1920-sample frames" in errors[0]
    one_stub.handle(7, False, True, {contract.AUDIO_IN: np.zeros(contract.FRAME_SAMPLES, np.float32)},
                  lambda outputs, last: sent.append(last), errors.append)
    assert sent == [] and "conversation 7 is not open" in errors[1]


def test_the_one_engines_pool_is_the_smaller_stages(one_stub):
    assert one_stub.engine.stage.num_slots == 2  # the talker's 2, not code2wav's 4
    assert one_stub.info.slots == 2 and one_stub.code2wav_info.slots == 4


def test_an_empty_end_request_ends_a_conversation(one_stub):
    """An end request without frames finishes after the frames before it, with no response of
    its own (no later stage to tell), and frees the conversation's slot: more conversations
    than the pool's 2 start one after another."""
    for conversation in (11, 12, 13):
        calls, done = [], threading.Event()
        one_stub.handle(conversation, True, False, {contract.AUDIO_IN: np.zeros(2 * contract.FRAME_SAMPLES, np.float32),
                                                     contract.VOICE: np.array([b"NATF0"], np.object_)},
                        lambda outputs, last: calls.append(("audio", outputs[contract.AUDIO_OUT].shape, last)),
                        lambda error: calls.append(("finish", error)))
        one_stub.handle(conversation, False, True, {contract.AUDIO_IN: np.zeros(0, np.float32)},
                        lambda outputs, last: calls.append(("end audio", last)),
                        lambda error: (calls.append(("end", error)), done.set()))
        assert done.wait(60)
        assert calls == [("audio", (contract.FRAME_SAMPLES,), False), ("audio", (contract.FRAME_SAMPLES,), True),
                         ("finish", None), ("end", None)]


def test_in_a_process_of_its_own_the_trace_reads_as_both_stages(tiny_checkpoint, tmp_path, monkeypatch):
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
    service = OneStubService(SpeechConfig(checkpoint=str(tiny_checkpoint), max_conversations=2, device="cpu",
                                          warm_personas=(), stage_process=True), code2wav_metrics=code2wav_metrics)
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


def test_a_failed_decode_is_tried_again_and_never_steps_the_talker_twice(tiny_checkpoint):
    """A decode that fails once is tried again within the tick; one that fails twice raises
    StepNotRepeatable, so the engine ends the conversations rather than step the talker again."""
    from personaplex_triton.core import loaders
    from personaplex_triton.core.errors import StepNotRepeatable
    from personaplex_triton.lm.sampling import SamplingParams
    from personaplex_triton.serving.stage_builds import build_one_tick
    from personaplex_triton.stages.persona import PersonaLibrary
    from personaplex_triton.stages.talker import TalkerSetup

    stage, _ = build_one_tick(config(tiny_checkpoint, code2wav_conversations=2, persona_cache_size=0).resolved(),
                              emit=lambda *_: None)
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
