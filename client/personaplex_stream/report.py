"""What a conversation gives back, and the latency report made from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from . import contract


def latency_percentiles(latencies_ms: Sequence[float], quantiles: Sequence[float] = (50, 95)) -> tuple:
    """The latencies' percentiles in ms (linear interpolation), p50 and p95 unless `quantiles`
    says otherwise; a None for each if there are none."""
    if len(latencies_ms) == 0:
        return (None,) * len(quantiles)
    return tuple(float(v) for v in np.percentile(np.asarray(latencies_ms, dtype=np.float64), quantiles))


def _rounded(x, digits: int = 2):
    return None if x is None else round(float(x), digits)


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
        p50, p95 = latency_percentiles(self.latencies_ms)
        return {
            "sequence_id": self.sequence_id,
            "frames_sent": self.frames_sent,
            "frames_received": self.frames_received,
            "audio_seconds": _rounded(self.audio_seconds, 3),
            "wall_s": _rounded(self.wall_s, 3),
            "real_time_factor": _rounded(self.real_time_factor, 3),
            "first_audio_ms": _rounded(self.first_audio_ms),
            "latency_ms_p50": _rounded(p50),
            "latency_ms_p95": _rounded(p95),
            "latency_ms_max": _rounded(max(self.latencies_ms)) if self.latencies_ms else None,
            "text": self.text,
        }
