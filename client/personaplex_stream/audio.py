"""Audio helpers shared by the client and the server: WAV I/O, resampling, framing.

numpy only (no scipy, no torch), so that the client installs light. The server library adds
loudness normalisation (`personaplex_triton.core.audio`).

All audio here is float32 mono in [-1, 1] at `contract.SAMPLE_RATE` (24 kHz) unless a
function says otherwise.
"""

from __future__ import annotations

import math
import os
import struct
import wave
from math import gcd

import numpy as np

from .contract import FRAME_SAMPLES, SAMPLE_RATE

__all__ = ["read_wav", "write_wav", "resample", "split_frames"]

_PCM, _IEEE_FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE


def _chunks(data: bytes):
    """(id, body) of each chunk of a RIFF/WAVE file's bytes."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("not a RIFF/WAVE file")
    pos = 12
    while pos + 8 <= len(data):
        size = int.from_bytes(data[pos + 4:pos + 8], "little")
        yield data[pos:pos + 4], data[pos + 8:pos + 8 + size]
        pos += 8 + size + (size & 1)  # chunks are padded to an even length


def _decode(fmt: bytes, body: bytes) -> tuple[int, np.ndarray]:
    """(sample rate, float32 [frames, channels]) of a `fmt ` chunk and a `data` chunk."""
    if len(fmt) < 16:
        raise ValueError("its fmt chunk is too short")
    tag, channels, rate, _, block_align, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == _EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack("<H", fmt[24:26])[0]  # the subformat GUID starts with the format tag
    if channels == 0 or block_align != channels * bits // 8:
        raise ValueError(f"inconsistent fmt chunk ({channels} channels of {bits} bits, block {block_align})")
    raw = np.frombuffer(body, np.uint8, len(body) - len(body) % block_align)
    if tag == _PCM and bits == 8:  # unsigned, 128 is zero
        pcm = (raw.astype(np.float32) - 128.0) / 128.0
    elif tag == _PCM and bits in (16, 32):
        ints = raw.view(f"<i{bits // 8}")
        pcm = (ints.astype(np.float64) / 2.0 ** (bits - 1)).astype(np.float32)
    elif tag == _PCM and bits == 24:
        triplets = raw.reshape(-1, 3).astype(np.int32)
        ints = (triplets[:, 0] | (triplets[:, 1] << 8) | (triplets[:, 2] << 16)) << 8 >> 8  # sign-extend
        pcm = (ints.astype(np.float64) / 2.0 ** 23).astype(np.float32)
    elif tag == _IEEE_FLOAT and bits in (32, 64):
        pcm = np.clip(raw.view(f"<f{bits // 8}").astype(np.float32), -1.0, 1.0)
    else:
        raise ValueError(f"unsupported WAV encoding (format tag {tag}, {bits} bits): "
                         "PCM of 8, 16, 24 or 32 bits, or float of 32 or 64 bits")
    return rate, pcm.reshape(-1, channels)


def read_wav(path: str | os.PathLike, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Read a WAV file as float32 mono in [-1, 1] at `sample_rate` Hz.

    Accepts PCM integer WAV of 8, 16, 24 or 32 bits, IEEE float WAV of 32 or 64 bits,
    WAVE_FORMAT_EXTENSIBLE headers, and any channel count. Channels are averaged to mono,
    then the signal is resampled (`resample`) when the file's rate differs from `sample_rate`.

    Raises ValueError naming the file when it is missing, not a WAV file, or of an
    unsupported encoding (e.g. compressed WAV).
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ValueError(f"cannot read WAV file {path!r}: no such file") from None
    except OSError as exc:
        raise ValueError(f"cannot read WAV file {path!r}: {exc}") from exc
    try:
        chunks = {}
        for chunk_id, body in _chunks(data):
            chunks.setdefault(chunk_id, body)
        if b"fmt " not in chunks or b"data" not in chunks:
            raise ValueError("no fmt or no data chunk")
        file_rate, pcm = _decode(chunks[b"fmt "], chunks[b"data"])
    except ValueError as exc:
        raise ValueError(f"cannot read WAV file {path!r}: {exc}") from exc
    pcm = pcm.mean(axis=1, dtype=np.float32)
    return np.clip(resample(pcm, file_rate, sample_rate), -1.0, 1.0).astype(np.float32, copy=False)


def write_wav(path: str | os.PathLike, pcm: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    """Write `pcm` (1-D float, nominally in [-1, 1]) as a 16-bit PCM mono WAV file.

    Samples are clipped to [-1, 1] and scaled by 32767 (rounded), so that +1.0 and
    -1.0 map to +32767 and -32767. NaNs are written as 0.
    """
    pcm = np.asarray(pcm, dtype=np.float64).reshape(-1)
    pcm = np.nan_to_num(pcm, nan=0.0, posinf=1.0, neginf=-1.0)
    ints = np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(os.fspath(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(ints.tobytes())


def _lowpass(num_taps: int, cutoff: float) -> np.ndarray:
    """A Kaiser-windowed (beta 5) sinc low-pass, `cutoff` relative to Nyquist, unit DC gain:
    scipy's `firwin(num_taps, cutoff, window=("kaiser", 5.0))`."""
    m = np.arange(num_taps) - (num_taps - 1) / 2
    taps = cutoff * np.sinc(cutoff * m) * np.kaiser(num_taps, 5.0)
    return taps / taps.sum()


def resample(pcm: np.ndarray, orig_rate: int, target_rate: int) -> np.ndarray:
    """Resample 1-D `pcm` from `orig_rate` to `target_rate` Hz (polyphase, float32).

    The same filter and alignment as scipy's `resample_poly(pcm, up, down)`, with the factor
    target/orig reduced by the rates' gcd (44.1 kHz -> 24 kHz: up 80, down 147). The output
    has ceil(len * target / orig) samples.
    """
    pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
    if orig_rate <= 0 or target_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_rate} -> {target_rate}")
    if orig_rate == target_rate or pcm.size == 0:
        return pcm.copy()
    g = gcd(int(orig_rate), int(target_rate))
    up, down = int(target_rate) // g, int(orig_rate) // g
    half_len = 10 * max(up, down)
    pre_pad = down - half_len % down  # puts the output samples at the filter's centre
    taps = np.concatenate([np.zeros(pre_pad), _lowpass(2 * half_len + 1, 1.0 / max(up, down)) * up])
    # Polyphase: output n sits at t = n * down on the upsampled grid and sums
    # taps[t % up + j * up] * pcm[t // up - j] over j.
    width = -(-taps.size // up)
    phases = np.zeros(width * up)
    phases[:taps.size] = taps
    phases = phases.reshape(width, up).T  # [phase, j]
    first = (half_len + pre_pad) // down
    t = (np.arange(-(-pcm.size * up // down)) + first) * down
    phase, newest = t % up, t // up + width  # `newest` indexes `padded`, whose pcm starts at width
    padded = np.zeros(width + max(pcm.size, int(newest.max()) - width + 1))
    padded[width:width + pcm.size] = pcm
    out = np.zeros(t.size)
    for j in range(width):
        out += phases[phase, j] * padded[newest - j]
    return out.astype(np.float32)


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
