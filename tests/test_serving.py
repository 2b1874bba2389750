"""The request layer of the stages, without Triton: input checks and code2wav's state."""

import re
import threading
import time

import numpy as np
import pytest

from personaplex_triton.core import contract, seam
from personaplex_triton.serving.parameters import Code2WavConfig
from personaplex_triton.serving.serving import Code2WavService, InputError, audio_frames, sampling_params


def test_audio_frames_accepts_whole_frames():
    frames = audio_frames(np.zeros(3 * 1920, np.float32))
    assert frames.shape == (3, 1920)
    assert audio_frames(np.zeros(0, np.float32)).shape == (0, 1920)


@pytest.mark.parametrize("audio, message", [
    (None, "missing input AUDIO_IN"),
    (np.zeros(1920, np.float64), "must be FP32"),
    (np.zeros((2, 1920), np.float32), "must be 1-D"),
    (np.zeros(1921, np.float32), "whole number of 1920-sample frames, got 1921"),
    (np.array([np.inf] * 1920, np.float32), "NaN or infinite"),
    (np.full(1920, -1.5, np.float32), r"in \[-1, 1\], got peak 1.5"),
])
def test_audio_frames_names_the_problem(audio, message):
    with pytest.raises(InputError, match=message):
        audio_frames(audio)


def test_sampling_params_from_inputs():
    params = sampling_params({contract.SEED: np.array([5]), contract.GREEDY: np.array([True]),
                              contract.TOP_K: np.array([10], np.int32),
                              contract.TEMPERATURE_TEXT: np.array([0.5], np.float32)})
    assert (params.seed, params.greedy, params.top_k, params.temperature_text) == (5, True, 10, 0.5)
    assert params.temperature == 0.8 and params.top_k_text == 25  # PersonaPlex's defaults
    assert sampling_params({}).seed != sampling_params({}).seed  # no SEED: a random one
    with pytest.raises(InputError, match=r"TEMPERATURE must lie in \(0, 10\], got 0"):
        sampling_params({contract.TEMPERATURE: np.array([0.0], np.float32)})
    with pytest.raises(InputError, match="SEED must hold one value"):
        sampling_params({contract.SEED: np.array([1, 2])})


@pytest.fixture(scope="module")
def code2wav(tiny_checkpoint):
    service = Code2WavService(Code2WavConfig(checkpoint=str(tiny_checkpoint), max_conversations=2, device="cpu"))
    yield service
    service.close()


def decode(service, conversation, frame_index, codes, final=False):
    out, errors, done = [], [], threading.Event()
    arrays = {seam.AGENT_CODES: np.asarray(codes, np.int64),
              seam.CONVERSATION_ID: np.array([conversation], np.uint64),
              seam.FRAME_INDEX: np.array([frame_index], np.int64),
              seam.FINAL: np.array([final]),
              seam.TEXT_PIECE: np.array([b" hi"], np.object_)}
    service.handle(arrays, lambda outputs, _last: out.append(outputs), lambda e: (errors.append(e), done.set()))
    assert done.wait(30)
    return out, errors[0]


def test_code2wav_keeps_state_per_conversation(code2wav):
    rng = np.random.default_rng(0)
    codes = rng.integers(0, seam.CODEBOOK_SIZE, (4, 8))
    first = [decode(code2wav, 1, i, c)[0][0][contract.AUDIO_OUT] for i, c in enumerate(codes)]
    assert all(a.shape == (1920,) and a.dtype == np.float32 for a in first)
    out, error = decode(code2wav, 1, 4, codes[0], final=True)
    assert error is None and out[0][contract.TEXT_OUT][0] == b" hi"
    # frame index 0 starts afresh: the same codes decode to the same audio, beside another stream
    again = []
    for i, c in enumerate(codes):
        decode(code2wav, 2, i, codes[::-1][i])
        again.append(decode(code2wav, 1, i, c)[0][0][contract.AUDIO_OUT])
    np.testing.assert_allclose(np.stack(again), np.stack(first), atol=1e-5)
    assert not np.allclose(first[1], first[2])


def test_code2wav_decodes_a_talker_ticks_frames_in_one_tick(code2wav):
    """Frames of one talker tick (seam.TICK) arriving apart, as its answers leave one by one,
    make one decoder tick once the last has come."""
    ticks = []
    decoder_tick = code2wav.code2wav.tick
    code2wav.code2wav.tick = lambda items: (ticks.append(len(items)), decoder_tick(items))[1]
    try:
        results = []
        for conversation in (11, 12):
            arrays = {seam.AGENT_CODES: np.ones(8, np.int64), seam.CONVERSATION_ID: np.array([conversation], np.uint64),
                      seam.FRAME_INDEX: np.array([0], np.int64), seam.FINAL: np.array([True]),
                      seam.TICK: np.array([77, 2], np.int64)}
            done = threading.Event()
            code2wav.handle(arrays, lambda outputs, _last: results.append(outputs), lambda e, d=done: d.set())
            time.sleep(0.005)  # longer than a quiet gap, well inside the gather's bound
            results.append(done)
        for done in results[1::2]:
            assert done.wait(30)
        assert ticks == [2]
    finally:
        code2wav.code2wav.tick = decoder_tick


@pytest.mark.parametrize("tick, message", [
    (np.array([1, 0], np.int64), r"TICK must be INT64 \[2\]: a talker tick's id and its frames \(>= 1\)"),
    (np.array([1, 2, 3], np.int64), "TICK must be INT64"),
])
def test_code2wav_refuses_a_bad_tick(code2wav, tick, message):
    out, errors, done = [], [], threading.Event()
    arrays = {seam.AGENT_CODES: np.ones(8, np.int64), seam.CONVERSATION_ID: np.array([5], np.uint64),
              seam.FRAME_INDEX: np.array([0], np.int64), seam.FINAL: np.array([True]), seam.TICK: tick}
    code2wav.handle(arrays, lambda outputs, _last: out.append(outputs), lambda e: (errors.append(e), done.set()))
    assert done.wait(30) and out == [] and re.search(message, errors[0])


@pytest.mark.parametrize("codes, frame_index, message", [
    ([1] * 7, 0, r"AGENT_CODES must be INT64 \[8\]"),
    ([2048] * 8, 0, r"must lie in \[0, 2048\)"),
    ([1] * 8, 3, "conversation 99 is not open"),
])
def test_code2wav_refuses_bad_frames(code2wav, codes, frame_index, message):
    out, error = decode(code2wav, 99, frame_index, codes)
    assert out == []
    assert re.search(message, error)


def test_frames_per_request_are_limited():
    from personaplex_triton.core import tunables

    audio_frames(np.zeros(tunables.MAX_FRAMES_PER_REQUEST * 1920, np.float32))
    with pytest.raises(InputError, match="holds 126 frames; the limit is 125 per request") as raised:
        audio_frames(np.zeros((tunables.MAX_FRAMES_PER_REQUEST + 1) * 1920, np.float32))
    assert raised.value.reason == "limit"


@pytest.mark.parametrize("inputs, message", [
    ({contract.TEMPERATURE: np.array([np.nan], np.float32)}, "TEMPERATURE must be a finite number, got nan"),
    ({contract.TEMPERATURE_TEXT: np.array([np.inf], np.float32), contract.GREEDY: np.array([True])},
     "TEMPERATURE_TEXT must be a finite number"),
    ({contract.TEMPERATURE: np.array([10.5], np.float32)}, r"TEMPERATURE must lie in \(0, 10\], got 10.5"),
    ({contract.TOP_K: np.array([0], np.int32)}, r"TOP_K must lie in \[1, 500\], got 0"),
    ({contract.TOP_K_TEXT: np.array([100000], np.int32)}, r"TOP_K_TEXT must lie in \[1, 500\], got 100000"),
    ({contract.SEED: np.array([b"x"], np.object_)}, "SEED must be a number"),
])
def test_sampling_values_are_checked(inputs, message):
    with pytest.raises(InputError, match=message):
        sampling_params(inputs)


def test_greedy_ignores_the_temperature_range():
    params = sampling_params({contract.GREEDY: np.array([True]), contract.TEMPERATURE: np.array([0.0], np.float32)})
    assert params.greedy and params.temperature == 0.0


def test_prompt_limits(files, monkeypatch):
    from personaplex_triton.core import loaders, tunables
    from personaplex_triton.stages.persona import PersonaLibrary, PromptTooLong

    library = PersonaLibrary(files, loaders.get_tokenizer(files))
    assert len(library.persona("NATF0", "Be brief.").text_tokens) > 0
    with pytest.raises(PromptTooLong, match="TEXT_PROMPT has 200000 characters; the limit is 4000"):
        library.persona("NATF0", "a" * 200_000)
    with pytest.raises(PromptTooLong, match=r"TEXT_PROMPT is \d+ tokens long; the limit is 256"):
        library.persona("NATF0", "hello there " * 300)
    monkeypatch.setattr(tunables, "MAX_VOICE_PROMPT_FRAMES", 10)
    with pytest.raises(PromptTooLong, match=r"voice 'NATF0.pt' is \d+ frames long; the limit is 10 \(0.8 s\)"):
        library.persona("NATF0", "")


def test_a_library_of_some_voices_loads_only_those_and_names_an_unknown_one(files):
    from personaplex_triton.core import loaders
    from personaplex_triton.stages.persona import PersonaLibrary

    tokenizer = loaders.get_tokenizer(files)
    some = PersonaLibrary(files, tokenizer, only=["NATM0"])
    assert some.voice("NATM0").name == "NATM0.pt"
    with pytest.raises(loaders.CheckpointError, match="voice NATF0.pt was added after the model loaded"):
        some.voice("NATF0")
    with pytest.raises(loaders.CheckpointError, match="unknown voice 'NOBODY'; this checkpoint has: NATF0, NATM0"):
        PersonaLibrary(files, tokenizer, only=["NOBODY"])


def test_code2wav_refuses_a_lost_frame_and_frees_on_a_close_marker(code2wav):
    codes = np.ones(8, np.int64)
    assert decode(code2wav, 5, 0, codes)[1] is None
    out, error = decode(code2wav, 5, 2, codes)  # frame 1 never came
    assert out == [] and "frame 2 of conversation 5 arrived where frame 1 was due" in error
    assert not code2wav.engine.is_open(5)
    assert decode(code2wav, 6, 0, codes)[1] is None
    out, error = decode(code2wav, 6, seam.CLOSE_ONLY, codes, final=True)
    assert out == [] and error is None
    assert not code2wav.engine.is_open(6)


def test_taking_the_largest_tick_leaves_every_slot_fresh(files):
    """code2wav takes its largest tick's memory at load on a GPU (a frame in every slot, then a
    reset of them all): afterwards a slot decodes as a fresh stream does."""
    from personaplex_triton.mimi.runtime import open_step
    from personaplex_triton.stages.code2wav import Code2Wav, CodesFrame

    codes = np.random.default_rng(5).integers(0, seam.CODEBOOK_SIZE, (3, 8))

    def decoded(decoder):
        decoder.prefill_many({1: None})
        return np.stack([decoder.tick({1: CodesFrame(c)})[1] for c in codes])

    fresh = decoded(Code2Wav(open_step("decoder", files), 3))
    warmed = Code2Wav(open_step("decoder", files), 3)
    warmed.tick({slot: CodesFrame(codes[0][::-1].copy()) for slot in range(3)})  # some state in every slot
    warmed.take_largest_tick()
    np.testing.assert_allclose(np.stack([warmed.tick({1: CodesFrame(c)})[1] for c in codes]), fresh, atol=1e-5)
