"""Each stage's ticks over a stretch of a run, from the stages' frame traces (core/trace.py):
how many ran a second, how many frames each carried, and the stage's busy fraction (its ticks'
summed duration over the wall time). A stage that ticks often with few frames a tick is busy
without carrying more: these say which."""

from __future__ import annotations

import numpy as np

from personaplex_triton.core import trace


def tick_figures(records: list[dict], start: float, end: float) -> dict | None:
    """The ticks that started in [start, end) (wall-clock seconds) among a stage's frame records
    (one per frame a tick carried): ticks, ticks per second, frames per tick (mean, p50, max),
    rows stepped (p50), tick time (p50, p99 ms) and the busy fraction; None if there were none."""
    if end <= start:
        raise ValueError(f"the stretch must end after it starts: {start} to {end}")
    ticks: dict[float, list] = {}  # by start: [seconds, frames carried, rows stepped]
    for record in records:
        if start <= record["tick_start"] < end:
            seconds = record["tick_end"] - record["tick_start"]
            ticks.setdefault(record["tick_start"], [seconds, 0, record["rows"]])[1] += 1
    if not ticks:
        return None
    seconds, frames, rows = np.array(list(ticks.values()), dtype=np.float64).T
    wall = end - start
    return {"ticks": len(ticks), "ticks_per_s": round(len(ticks) / wall, 2),
            "frames_per_tick_mean": round(float(frames.mean()), 2), "frames_per_tick_p50": float(np.median(frames)),
            "frames_per_tick_max": int(frames.max()), "rows_p50": float(np.median(rows)),
            "tick_ms_p50": round(1000 * float(np.median(seconds)), 2),
            "tick_ms_p99": round(1000 * float(np.percentile(seconds, 99)), 2),
            "busy_fraction": round(float(seconds.sum()) / wall, 3)}


def stage_ticks(records: dict[str, list[dict]], start: float, end: float) -> dict:
    """{stage: tick_figures of its `records` (trace.read_answered)} for both stages (None where none ticked)."""
    return {stage: tick_figures(records[stage], start, end) for stage in trace.STAGES}
