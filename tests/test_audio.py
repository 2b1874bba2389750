"""Unit tests of personaplex_triton.core.audio and the client's personaplex_stream.audio under it
(no server, no torch)."""

import math
import struct
import wave

import numpy as np
import pyloudnorm
import pytest
from scipy.io import wavfile
from scipy.signal import resample_poly

from personaplex_triton.core import audio
from personaplex_triton.core.contract import FRAME_SAMPLES, SAMPLE_RATE


def _sine(freq, seconds, rate, amp=0.5):
    t = np.arange(int(round(seconds * rate))) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _peak_hz(pcm, rate):
    spec = np.abs(np.fft.rfft(pcm * np.hanning(pcm.size)))
    return np.argmax(spec) * rate / pcm.size


def _write_raw_wav(path, rate, channels, bits, samples_bytes, format_tag=1, extensible=False):
    """Write a WAV header by hand around already-interleaved little-endian sample bytes."""
    block_align = channels * bits // 8
    if extensible:
        subformat = struct.pack("<H", format_tag) + b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
        fmt = struct.pack("<HHIIHHHHI", 0xFFFE, channels, rate, rate * block_align, block_align, bits,
                          22, bits, 0) + subformat
    else:
        fmt = struct.pack("<HHIIHH", format_tag, channels, rate, rate * block_align, block_align, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(samples_bytes)) + samples_bytes
    if len(samples_bytes) % 2:
        body += b"\x00"
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", len(body)) + body)


def _int24_bytes(x):
    ints = np.round(np.clip(x, -1, 1) * (2**23 - 1)).astype("<i4")
    return ints.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()


# ----------------------------------------------------------------------------- read / write


def test_write_read_round_trip(tmp_path):
    pcm = _sine(440, 1.0, SAMPLE_RATE, amp=0.8)
    path = tmp_path / "x.wav"
    audio.write_wav(path, pcm)
    with wave.open(str(path)) as w:  # really 16-bit mono 24 kHz
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SAMPLE_RATE)
        assert w.getnframes() == pcm.size
    back = audio.read_wav(path)
    assert back.dtype == np.float32 and back.shape == pcm.shape
    assert np.max(np.abs(back - pcm)) < 2.0 / 32768


def test_write_clips(tmp_path):
    path = tmp_path / "clip.wav"
    audio.write_wav(path, np.array([2.0, -3.0, 0.5, np.nan], dtype=np.float32))
    _, ints = wavfile.read(path)
    assert ints.tolist() == [32767, -32767, 16384, 0]


def test_stereo_44k1_read_as_24k_mono(tmp_path):
    rate, seconds = 44100, 1.5
    left = _sine(1000, seconds, rate, amp=0.6)
    right = _sine(1000, seconds, rate, amp=0.2)
    stereo = np.stack([left, right], axis=1)
    path = tmp_path / "stereo.wav"
    wavfile.write(path, rate, np.round(stereo * 32767).astype(np.int16))

    pcm = audio.read_wav(path)  # default 24 kHz
    assert pcm.dtype == np.float32 and pcm.ndim == 1
    # 44.1 kHz -> 24 kHz is 80/147
    assert pcm.size == int(np.ceil(left.size * 80 / 147))
    assert abs(pcm.size - seconds * SAMPLE_RATE) <= 1
    assert abs(_peak_hz(pcm, SAMPLE_RATE) - 1000) < 2
    # downmix is the channel mean: amplitude (0.6 + 0.2) / 2, checked away from the edges
    mid = pcm[2000:-2000]
    assert np.max(np.abs(mid)) == pytest.approx(0.4, abs=0.01)
    expected = _sine(1000, seconds, SAMPLE_RATE, amp=0.4)[: pcm.size]
    assert np.max(np.abs(pcm[2000:-2000] - expected[2000:-2000])) < 0.01


def test_read_resamples_to_requested_rate(tmp_path):
    path = tmp_path / "x.wav"
    audio.write_wav(path, _sine(300, 1.0, SAMPLE_RATE), SAMPLE_RATE)
    pcm16k = audio.read_wav(path, sample_rate=16000)
    assert pcm16k.size == 16000
    assert abs(_peak_hz(pcm16k, 16000) - 300) < 2


@pytest.mark.parametrize("orig, target", [(44100, 24000), (48000, 24000), (16000, 24000), (22050, 24000),
                                           (8000, 24000), (24000, 16000)])
def test_resample_is_scipys_resample_poly(orig, target):
    """The client resamples with numpy alone, and gets what scipy's polyphase filter gives."""
    pcm = np.random.default_rng(orig).uniform(-0.5, 0.5, orig // 2 + 37).astype(np.float32)
    g = math.gcd(orig, target)
    expected = resample_poly(pcm, target // g, orig // g)
    got = audio.resample(pcm, orig, target)
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.max(np.abs(got - expected)) < 1e-6


@pytest.mark.parametrize("kind", ["u8", "i16", "i24", "i32", "f32", "f64", "i24-extensible", "f32-extensible"])
def test_read_sample_formats(tmp_path, kind):
    rate, channels = 48000, 3
    x = _sine(500, 0.5, rate, amp=0.5)
    multi = np.stack([x] * channels, axis=1)  # identical channels: mono is x
    path = tmp_path / f"{kind}.wav"
    if kind == "u8":
        wavfile.write(path, rate, np.round(multi * 127 + 128).astype(np.uint8))
        tol = 2.0 / 128
    elif kind == "i16":
        wavfile.write(path, rate, np.round(multi * 32767).astype(np.int16))
        tol = 1e-3
    elif kind.startswith("i24"):
        _write_raw_wav(path, rate, channels, 24, _int24_bytes(multi.reshape(-1)), extensible="ext" in kind)
        tol = 1e-3
    elif kind == "i32":
        wavfile.write(path, rate, np.round(multi * (2**31 - 1)).astype(np.int32))
        tol = 1e-3
    elif kind.startswith("f32"):
        if "ext" in kind:
            _write_raw_wav(path, rate, channels, 32, multi.astype("<f4").tobytes(), format_tag=3, extensible=True)
        else:
            wavfile.write(path, rate, multi.astype(np.float32))
        tol = 1e-3
    else:
        wavfile.write(path, rate, multi.astype(np.float64))
        tol = 1e-3
    pcm = audio.read_wav(path)
    assert pcm.dtype == np.float32 and pcm.size == x.size // 2  # 48 kHz -> 24 kHz
    expected = _sine(500, 0.5, SAMPLE_RATE, amp=0.5)
    assert np.max(np.abs(pcm[200:-200] - expected[200:-200])) < tol + 5e-3
    assert abs(_peak_hz(pcm, SAMPLE_RATE) - 500) < 5


def test_read_float_wav_is_clipped(tmp_path):
    path = tmp_path / "loud.wav"
    wavfile.write(path, SAMPLE_RATE, np.array([0.0, 1.5, -2.0, 0.25], dtype=np.float32))
    pcm = audio.read_wav(path)
    assert pcm.tolist() == [0.0, 1.0, -1.0, 0.25]


def test_read_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.wav"
    with pytest.raises(ValueError, match="nope.wav"):
        audio.read_wav(missing)
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"this is not a wav file at all" * 10)
    with pytest.raises(ValueError, match="garbage.wav"):
        audio.read_wav(garbage)
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.wav"):
        audio.read_wav(empty)
    alaw = tmp_path / "alaw.wav"  # format tag 6 (A-law) is not PCM
    _write_raw_wav(alaw, 8000, 1, 8, b"\x55" * 800, format_tag=6)
    with pytest.raises(ValueError, match="alaw.wav"):
        audio.read_wav(alaw)


# ----------------------------------------------------------------------------- framing


def test_split_frames_pads_last_frame():
    pcm = np.arange(1, 2 * FRAME_SAMPLES + 101, dtype=np.float32)
    frames = audio.split_frames(pcm)
    assert frames.shape == (3, FRAME_SAMPLES) and frames.dtype == np.float32
    assert np.array_equal(frames.reshape(-1)[: pcm.size], pcm)
    assert np.all(frames[2, 100:] == 0) and frames[2, 99] == pcm[-1]


def test_split_frames_exact_and_empty():
    assert audio.split_frames(np.ones(3 * FRAME_SAMPLES)).shape == (3, FRAME_SAMPLES)
    empty = audio.split_frames(np.zeros(0, dtype=np.float32))
    assert empty.shape == (0, FRAME_SAMPLES)
    assert audio.split_frames(np.ones(5), frame_samples=4).tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]


# ----------------------------------------------------------------------------- loudness


@pytest.mark.parametrize("target", [-23.0, -16.0, -30.0])
def test_loudness_normalize_reaches_target(target):
    rng = np.random.default_rng(0)
    pcm = (0.05 * rng.standard_normal(3 * SAMPLE_RATE)).astype(np.float32)
    pcm[SAMPLE_RATE : SAMPLE_RATE + 8000] *= 4  # not stationary
    out = audio.loudness_normalize(pcm, SAMPLE_RATE, target)
    assert out.dtype == np.float32 and out.shape == pcm.shape
    measured = pyloudnorm.Meter(SAMPLE_RATE).integrated_loudness(out.astype(np.float64))
    assert abs(measured - target) < 0.5
    # a pure gain: the shape of the signal is unchanged
    ratio = out[pcm != 0] / pcm[pcm != 0]
    assert np.allclose(ratio, ratio[0], rtol=1e-4)


def test_loudness_normalize_leaves_silence_and_short_audio():
    silence = np.zeros(2 * SAMPLE_RATE, dtype=np.float32)
    out = audio.loudness_normalize(silence, SAMPLE_RATE, -23.0)
    assert np.array_equal(out, silence)
    tiny = np.full(2 * SAMPLE_RATE, 1e-6, dtype=np.float32)  # below the -70 LUFS gate
    out = audio.loudness_normalize(tiny, SAMPLE_RATE, -23.0)
    assert np.all(np.isfinite(out)) and np.array_equal(out, tiny)
    short = _sine(440, 0.1, SAMPLE_RATE)  # shorter than a 400 ms block
    out = audio.loudness_normalize(short, SAMPLE_RATE, -23.0)
    assert np.array_equal(out, short)
