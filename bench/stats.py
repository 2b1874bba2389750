"""The figures of a real-time speech server, from per-frame latencies: no server needed.

A frame is late when its answer comes more than one frame duration (80 ms) after it was
sent: a live conversation then falls behind its speaker. A load is real time when p99 stays
under 80 ms and no frame is late.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from personaplex_stream import latency_percentiles
from personaplex_triton.core import contract

FRAME_MS = 1000.0 * contract.FRAME_SAMPLES / contract.SAMPLE_RATE  # 80 ms
QUANTILES = (50, 95, 99)


def percentiles(values_ms: Sequence[float], quantiles: Iterable[int] = QUANTILES) -> dict[str, float | None]:
    """{"p50": ..., "p95": ..., "p99": ...} (linear interpolation), None for each when empty."""
    quantiles = tuple(quantiles)
    found = latency_percentiles(values_ms, quantiles)
    return {f"p{q}": None if v is None else round(v, 1) for q, v in zip(quantiles, found)}


def late_frames(latencies_ms: Sequence[float], budget_ms: float = FRAME_MS) -> int:
    """How many frames were answered more than `budget_ms` after they were sent."""
    return int(np.count_nonzero(np.asarray(latencies_ms, dtype=np.float64) > budget_ms))


def frame_summary(latencies_ms: Sequence[float], budget_ms: float = FRAME_MS) -> dict:
    """Frames, p50 / p95 / p99, late frames (count and fraction) and whether it is real time."""
    late = late_frames(latencies_ms, budget_ms)
    summary = {"frames": len(latencies_ms), **percentiles(latencies_ms), "late": late,
               "late_fraction": round(late / len(latencies_ms), 3) if len(latencies_ms) else None}
    summary["real_time"] = is_real_time(summary, budget_ms)
    return summary


def is_real_time(summary: dict, budget_ms: float = FRAME_MS) -> bool:
    return summary["frames"] > 0 and summary["p99"] < budget_ms and summary["late"] == 0


def largest_real_time(rows: Sequence[dict], key: str = "conversations") -> int | None:
    """The largest load (rows[i][key]) up to which every tested load was real time, or None.

    A load past a failed one does not count: a pass there is noise, not capacity.
    """
    best = None
    for row in sorted(rows, key=lambda r: r[key]):
        if not row["real_time"]:
            break
        best = row[key]
    return best
