"""The figures of a real-time speech server, from per-frame latencies: no server needed.

A frame is late when its answer comes more than one frame duration (80 ms) after it was
sent: a live conversation then falls behind its speaker. A load is real time when p99 stays
under 80 ms and no frame is late. A load is *held* (issue 25's bar, which the benchmark's
verdict follows) when p99 is under 80 ms, at most 0.1% of frames are late, none is later than
160 ms, and no start failed under capacity.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from personaplex_stream import latency_percentiles
from personaplex_triton.core import contract

FRAME_MS = 1000.0 * contract.FRAME_SAMPLES / contract.SAMPLE_RATE  # 80 ms
QUANTILES = (50, 95, 99)
HELD_LATE_FRACTION = 0.001    # at most 0.1% of frames over 80 ms
HELD_MAX_MS = 2 * FRAME_MS     # and none over 160 ms
# What the server says when it refuses a start for want of room: issue 25's admission error, and
# the slot pool's own refusal before it.
CAPACITY_REFUSALS = ("at capacity", "conversation slots are busy")


def percentiles(values_ms: Sequence[float], quantiles: Iterable[int] = QUANTILES) -> dict[str, float | None]:
    """{"p50": ..., "p95": ..., "p99": ...} (linear interpolation), None for each when empty."""
    quantiles = tuple(quantiles)
    found = latency_percentiles(values_ms, quantiles)
    return {f"p{q}": None if v is None else round(v, 1) for q, v in zip(quantiles, found)}


def late_frames(latencies_ms: Sequence[float], budget_ms: float = FRAME_MS) -> int:
    """How many frames were answered more than `budget_ms` after they were sent."""
    return int(np.count_nonzero(np.asarray(latencies_ms, dtype=np.float64) > budget_ms))


def frame_summary(latencies_ms: Sequence[float], budget_ms: float = FRAME_MS) -> dict:
    """Frames, p50 / p95 / p99, late frames (count and fraction), frames over 160 ms, the
    largest latency, and whether it is real time."""
    late = late_frames(latencies_ms, budget_ms)
    summary = {"frames": len(latencies_ms), **percentiles(latencies_ms), "late": late,
               "late_fraction": round(late / len(latencies_ms), 5) if len(latencies_ms) else None,
               "over_160": late_frames(latencies_ms, HELD_MAX_MS),
               "max": round(float(max(latencies_ms)), 1) if len(latencies_ms) else None}
    summary["real_time"] = is_real_time(summary, budget_ms)
    return summary


def is_real_time(summary: dict, budget_ms: float = FRAME_MS) -> bool:
    return summary["frames"] > 0 and summary["p99"] < budget_ms and summary["late"] == 0


def is_capacity_refusal(error: str) -> bool:
    """Whether a failed start's message is the server's refusal for want of room."""
    return any(marker in error for marker in CAPACITY_REFUSALS)


def held(summary: dict, conversations: int, pool: int | None, errors: Sequence[str]) -> dict:
    """Issue 25's verdict on one load level: {"held": bool, "why": str, "refused_at_capacity": n,
    "failed_under_capacity": n}. `summary` is frame_summary of the served frames; `conversations`
    the level's conversations at once, `pool` the talker's slots (None: unknown); `errors` the
    message of each conversation that failed. A start refused at capacity is no failure when the
    level exceeds the pool, but is reported; any other failure, or a refusal within the pool (or
    with the pool unknown), is a failed start under capacity."""
    refused = [e for e in errors if is_capacity_refusal(e)]
    past_pool = pool is not None and conversations > pool
    failed = len(errors) - (len(refused) if past_pool else 0)
    not_held = []
    if not summary["frames"]:
        not_held.append("no frame answered")
    else:
        if summary["p99"] >= FRAME_MS:
            not_held.append(f"p99 {summary['p99']} ms is not under {FRAME_MS:g} ms")
        if summary["late"] > HELD_LATE_FRACTION * summary["frames"]:
            not_held.append(f"{summary['late']} of {summary['frames']} frames over {FRAME_MS:g} ms "
                            f"({summary['late'] / summary['frames']:.2%}, more than {HELD_LATE_FRACTION:.1%})")
        if summary["over_160"]:
            not_held.append(f"{summary['over_160']} frames over {HELD_MAX_MS:g} ms (max {summary['max']} ms)")
    if len(errors) > len(refused):
        not_held.append(f"{len(errors) - len(refused)} conversations failed, not refused at capacity")
    if refused and not past_pool:  # e.g. an admission by time that refuses before the pool is full
        within = f"within the pool of {pool}" if pool is not None else "with the pool size unknown (give --metrics-url)"
        not_held.append(f"{len(refused)} starts refused at capacity {within}: failed starts under capacity")
    notes = [f"{len(refused)} starts refused at capacity (pool {pool})"] if refused and past_pool else []
    if not_held:
        why = "; ".join(not_held + notes)
    else:
        why = "; ".join([f"p99 {summary['p99']} ms, {summary['late']} of {summary['frames']} frames over "
                         f"{FRAME_MS:g} ms, max {summary['max']} ms"] + notes)
    return {"held": not not_held, "why": why, "refused_at_capacity": len(refused),
            "failed_under_capacity": failed}


def largest_held(rows: Sequence[dict], key: str = "conversations") -> int | None:
    """The largest load (rows[i][key]) up to which every tested load was held, or None.

    A load past one not held does not count: a pass there is noise, not capacity.
    """
    best = None
    for row in sorted(rows, key=lambda r: r[key]):
        if not row["held"]:
            break
        best = row[key]
    return best


def windows(send_s: Sequence[float], latencies_ms: Sequence[float], window_s: float = 10.0) -> list[dict]:
    """Frames grouped by when they were sent (`send_s[i]`, seconds from the level's start), one
    group per `window_s`: per window its start, frames, p50 / p99 and frames over 80 ms, so that
    a drift along the run shows (an empty window: frames 0, percentiles None)."""
    if window_s <= 0:
        raise ValueError(f"window_s must be positive, got {window_s}")
    if len(send_s) != len(latencies_ms):
        raise ValueError(f"{len(send_s)} send times for {len(latencies_ms)} latencies")
    if not len(send_s):
        return []
    index = window_index(send_s, window_s)
    latencies = np.asarray(latencies_ms, dtype=np.float64)
    found = []
    for w in range(int(index.max()) + 1):
        inside = latencies[index == w]
        found.append({"start_s": round(w * window_s, 1), "frames": int(inside.size),
                      **percentiles(inside.tolist(), (50, 99)), "late": late_frames(inside)})
    return found


def near_starts(conversations: Sequence[tuple[float, bool, Sequence[float], Sequence[float]]],
                within_s: float = 1.0) -> dict:
    """What new personas' starts cost the others: `conversations` are (start_s, new, send_s,
    latencies_ms) each, times in seconds from the level's start. Frames of the other
    conversations sent within `within_s` of a new persona's start (`near`), the newcomers' own
    frames sent within `within_s` of their start (`own`: they wait for it), and the rest: frames,
    late (over 80 ms) and over 160 ms of each."""
    starts = [start for start, new, _, _ in conversations if new]
    groups: dict[str, list[float]] = {"near": [], "own": [], "elsewhere": []}
    for start, new, send_s, latencies_ms in conversations:
        for sent, ms in zip(send_s, latencies_ms):
            if new and abs(sent - start) <= within_s:
                groups["own"].append(ms)
            elif any(abs(sent - other) <= within_s for other in starts if not (new and other == start)):
                groups["near"].append(ms)
            else:
                groups["elsewhere"].append(ms)
    return {"within_s": within_s, **{name: {"frames": len(ms), "late": late_frames(ms),
                                            "over_160": late_frames(ms, HELD_MAX_MS)} for name, ms in groups.items()}}


def each_start(conversations: Sequence[tuple[float, bool, Sequence[float], Sequence[float]]],
               within_s: float = 1.0) -> list[dict]:
    """Each new persona's start on its own (`conversations` as near_starts takes them), in order:
    when it was (s from the level's start), and the other conversations' frames sent within
    `within_s` of it: how many, late (over 80 ms) and over 160 ms."""
    found = []
    for at in sorted(start for start, new, _, _ in conversations if new):
        ms = np.concatenate([np.asarray(latencies_ms, dtype=np.float64)[np.abs(np.asarray(send_s) - at) <= within_s]
                             for start, new, send_s, latencies_ms in conversations
                             if not (new and start == at) and len(send_s)] or [np.zeros(0)])
        found.append({"start_s": round(at, 2), "frames": int(ms.size), "late": late_frames(ms),
                      "over_160": late_frames(ms, HELD_MAX_MS)})
    return found


def window_index(send_s: Sequence[float], window_s: float = 10.0) -> np.ndarray:
    """The window of `windows` that each send time falls in (one sent before the level's start: the first)."""
    return np.floor(np.maximum(np.asarray(send_s, dtype=np.float64), 0.0) / window_s).astype(int)


def recovery_s(send_s: Sequence[float], latencies_ms: Sequence[float], freeze_end_s: float,
               budget_ms: float = FRAME_MS) -> float | None:
    """How long after a freeze's end (`freeze_end_s`, on `send_s`'s clock) frames were answered in
    time again: the least R from which every frame sent more than R after the end took at most
    `budget_ms`: the send time of the last late frame sent after the end, less the end (0: none
    was late). None: the last frame sent was late, so the level never recovered."""
    send = np.asarray(send_s, dtype=np.float64)
    late = (send > freeze_end_s) & (np.asarray(latencies_ms, dtype=np.float64) > budget_ms)
    if not late.any():
        return 0.0
    last = float(send[late].max())
    if last >= float(send.max()):
        return None
    return round(last - freeze_end_s, 3)
