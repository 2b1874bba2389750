"""Audio helpers shared by the client and the server: WAV I/O, framing, loudness.

Only numpy and scipy are used (no torch), so that the client stays light.

All audio here is float32 mono in [-1, 1] at `contract.SAMPLE_RATE` (24 kHz) unless a
function says otherwise.
"""

from __future__ import annotations

import math
import os
import warnings
from math import gcd

import numpy as np
from scipy.io import wavfile
from scipy.signal import resample_poly

from .contract import FRAME_SAMPLES, SAMPLE_RATE

__all__ = ["read_wav", "write_wav", "resample", "split_frames", "loudness_normalize"]


def _to_float(data: np.ndarray) -> np.ndarray:
    """Scale integer or float WAV samples to float32 in [-1, 1] (any shape)."""
    if data.dtype == np.uint8:
        # 8-bit WAV is unsigned with 128 as zero.
        return (data.astype(np.float32) - 128.0) / 128.0
    if np.issubdtype(data.dtype, np.signedinteger):
        # scipy returns 24-bit PCM left-justified in int32, so dividing by the
        # container's full scale is right for 16-, 24- and 32-bit data alike.
        full_scale = float(np.iinfo(data.dtype).max) + 1.0
        return (data.astype(np.float64) / full_scale).astype(np.float32)
    if np.issubdtype(data.dtype, np.floating):
        return np.clip(data.astype(np.float32), -1.0, 1.0)
    raise ValueError(f"unsupported WAV sample type {data.dtype}")


def resample(pcm: np.ndarray, orig_rate: int, target_rate: int) -> np.ndarray:
    """Resample 1-D `pcm` from `orig_rate` to `target_rate` Hz (polyphase, float32).

    The rational factor target/orig is reduced by their gcd, so 44.1 kHz -> 24 kHz
    uses up=80, down=147. The output has ceil(len * target / orig) samples.
    """
    pcm = np.asarray(pcm, dtype=np.float32)
    if orig_rate <= 0 or target_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_rate} -> {target_rate}")
    if orig_rate == target_rate or pcm.size == 0:
        return pcm.copy()
    g = gcd(int(orig_rate), int(target_rate))
    up, down = int(target_rate) // g, int(orig_rate) // g
    return resample_poly(pcm, up, down).astype(np.float32)


def read_wav(path: str | os.PathLike, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Read a WAV file as float32 mono in [-1, 1] at `sample_rate` Hz.

    Accepts PCM integer WAV of 8, 16, 24 or 32 bits, IEEE float WAV of 32 or 64 bits,
    WAVE_FORMAT_EXTENSIBLE headers, and any channel count. Channels are averaged to
    mono, then the signal is resampled with a polyphase filter (scipy's
    `resample_poly`) when the file's rate differs from `sample_rate`.

    Raises ValueError naming the file when it is missing, not a WAV file, or of an
    unsupported encoding (e.g. compressed WAV).
    """
    path = os.fspath(path)
    try:
        with warnings.catch_warnings():
            # scipy warns about chunks it skips (LIST, fact, ...); they are harmless.
            warnings.simplefilter("ignore", wavfile.WavFileWarning)
            file_rate, data = wavfile.read(path)
    except FileNotFoundError:
        raise ValueError(f"cannot read WAV file {path!r}: no such file") from None
    except (ValueError, OSError, EOFError, TypeError) as exc:  # bad header, bad format, truncated
        raise ValueError(f"cannot read WAV file {path!r}: {exc}") from exc
    try:
        pcm = _to_float(np.asarray(data))
    except ValueError as exc:
        raise ValueError(f"cannot read WAV file {path!r}: {exc}") from exc
    if pcm.ndim == 2:
        pcm = pcm.mean(axis=1, dtype=np.float32) if pcm.shape[1] > 0 else np.zeros(0, np.float32)
    elif pcm.ndim != 1:
        raise ValueError(f"cannot read WAV file {path!r}: unexpected data shape {pcm.shape}")
    pcm = resample(pcm, int(file_rate), int(sample_rate))
    return np.clip(pcm, -1.0, 1.0).astype(np.float32, copy=False)


def write_wav(path: str | os.PathLike, pcm: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    """Write `pcm` (1-D float, nominally in [-1, 1]) as a 16-bit PCM mono WAV file.

    Samples are clipped to [-1, 1] and scaled by 32767 (rounded), so that +1.0 and
    -1.0 map to +32767 and -32767. NaNs are written as 0.
    """
    pcm = np.asarray(pcm, dtype=np.float64).reshape(-1)
    pcm = np.nan_to_num(pcm, nan=0.0, posinf=1.0, neginf=-1.0)
    ints = np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2")
    wavfile.write(os.fspath(path), int(sample_rate), ints)


def split_frames(pcm: np.ndarray, frame_samples: int = FRAME_SAMPLES) -> np.ndarray:
    """Cut 1-D `pcm` into consecutive frames: float32 array [n, frame_samples].

    n = ceil(len(pcm) / frame_samples); the last frame is zero-padded. An empty input
    gives an array of shape [0, frame_samples].
    """
    if frame_samples <= 0:
        raise ValueError(f"frame_samples must be positive, got {frame_samples}")
    pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
    n = math.ceil(pcm.size / frame_samples)
    frames = np.zeros((n, frame_samples), dtype=np.float32)
    frames.reshape(-1)[: pcm.size] = pcm
    return frames


def loudness_normalize(pcm: np.ndarray, sample_rate: int, target_lufs: float) -> np.ndarray:
    """Scale `pcm` so its integrated loudness (ITU-R BS.1770, pyloudnorm) is `target_lufs`.

    The gain is measured over the whole signal. Audio whose loudness cannot be measured
    (shorter than one 400 ms gating block, silent, or entirely below the -70 LUFS
    absolute gate) is returned unchanged rather than amplified to inf/nan. The result
    is float32 and is not clipped: a large positive gain can push peaks beyond 1.
    """
    import pyloudnorm  # imported here: only needed by callers that normalise

    pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
    block_size = 0.400
    if pcm.size < math.ceil(block_size * sample_rate) or not np.any(pcm):
        return pcm.copy()
    meter = pyloudnorm.Meter(sample_rate, block_size=block_size)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # log10(0) inside the meter on silent blocks
            loudness = meter.integrated_loudness(pcm.astype(np.float64))
    except ValueError:  # pyloudnorm's own input validation
        return pcm.copy()
    if not np.isfinite(loudness):
        return pcm.copy()
    gain = 10.0 ** ((float(target_lufs) - loudness) / 20.0)
    out = (pcm.astype(np.float64) * gain).astype(np.float32)
    if not np.all(np.isfinite(out)):
        return pcm.copy()
    return out
