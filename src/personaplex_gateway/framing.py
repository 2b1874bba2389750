"""Audio in the shapes the wire wants: 1920-sample frames out of chunks of any length, and
16-bit PCM to and from float32."""

from __future__ import annotations

import numpy as np
from personaplex_stream import contract

FRAME_SAMPLES = contract.FRAME_SAMPLES
FRAME_SECONDS = contract.FRAME_SAMPLES / contract.SAMPLE_RATE


class FrameBuffer:
    """Collects float32 samples and hands them back as whole frames; a partial frame waits
    for the next chunk (never more than one frame is held). Samples are clipped to [-1, 1], as
    the wire contract requires: a codec's output overshoots at times (Opus decoded a peak of
    1.00003 from PersonaPlex's web client, and the server refused the frame)."""

    def __init__(self, frame_samples: int = FRAME_SAMPLES):
        self.frame_samples = frame_samples
        self._pending = np.zeros(0, dtype=np.float32)

    def push(self, samples: np.ndarray) -> list[np.ndarray]:
        chunk = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
        joined = np.concatenate([self._pending, chunk])
        whole = joined.size // self.frame_samples
        frames = [joined[i * self.frame_samples:(i + 1) * self.frame_samples] for i in range(whole)]
        self._pending = joined[whole * self.frame_samples:]
        return frames

    @property
    def pending_samples(self) -> int:
        return self._pending.size


def pcm16_to_float(data: bytes) -> np.ndarray:
    """Little-endian 16-bit mono PCM to float32 in [-1, 1)."""
    if len(data) % 2:
        raise ValueError(f"16-bit PCM has an even number of bytes, got {len(data)}")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def float_to_pcm16(samples: np.ndarray) -> bytes:
    """float32 in [-1, 1] to little-endian 16-bit PCM (clipped)."""
    scaled = np.clip(np.asarray(samples, dtype=np.float32) * 32768.0, -32768, 32767)
    return np.round(scaled).astype("<i2").tobytes()
