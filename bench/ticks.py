"""Each stage's ticks over a stretch of a run, from the stages' frame traces (core/trace.py):
how many ran a second, how many frames each carried, and the stage's busy fraction (its ticks'
summed duration over the wall time). A stage that ticks often with few frames a tick is busy
without carrying more: these say which. And how long the ticks spent off the CPU (their wall
time less their thread's CPU time; a GPU wait spins, so this is waiting for the GIL or a lock),
over all ticks and over the slowest 1%: whether the slow ones wait on the host or on the GPU."""

from __future__ import annotations

import numpy as np

from personaplex_triton.core import trace


def tick_figures(records: list[dict], start: float, end: float) -> dict | None:
    """The ticks that started in [start, end) (wall-clock seconds) among a stage's frame records
    (one per frame a tick carried): ticks, ticks per second, frames per tick (mean, p50, max),
    rows stepped (p50), tick time (p50, p99 ms), the busy fraction, and the time off the CPU
    (p50, p99 ms, and the p50 over the ticks at or above the p99 tick time; None from traces
    that do not keep the tick's CPU time); None if there were none."""
    if end <= start:
        raise ValueError(f"the stretch must end after it starts: {start} to {end}")
    ticks: dict[float, list] = {}  # by start: [seconds, frames carried, rows stepped, CPU seconds]
    for record in records:
        if start <= record["tick_start"] < end:
            seconds = record["tick_end"] - record["tick_start"]
            cpu = record.get("tick_cpu", np.nan)
            ticks.setdefault(record["tick_start"], [seconds, 0, record["rows"], cpu])[1] += 1
    if not ticks:
        return None
    seconds, frames, rows, cpu = np.array(list(ticks.values()), dtype=np.float64).T
    wall = end - start
    slowest = seconds >= np.percentile(seconds, 99)
    off_cpu = None if np.isnan(cpu).any() else 1000 * np.maximum(seconds - cpu, 0.0)
    return {"ticks": len(ticks), "ticks_per_s": round(len(ticks) / wall, 2),
            "frames_per_tick_mean": round(float(frames.mean()), 2), "frames_per_tick_p50": float(np.median(frames)),
            "frames_per_tick_max": int(frames.max()), "rows_p50": float(np.median(rows)),
            "tick_ms_p50": round(1000 * float(np.median(seconds)), 2),
            "tick_ms_p99": round(1000 * float(np.percentile(seconds, 99)), 2),
            "busy_fraction": round(float(seconds.sum()) / wall, 3),
            "off_cpu_ms_p50": None if off_cpu is None else round(float(np.median(off_cpu)), 2),
            "off_cpu_ms_p99": None if off_cpu is None else round(float(np.percentile(off_cpu, 99)), 2),
            "slowest_off_cpu_ms_p50": None if off_cpu is None else round(float(np.median(off_cpu[slowest])), 2)}


def stage_ticks(records: dict[str, list[dict]], start: float, end: float) -> dict:
    """{stage: tick_figures of its `records` (trace.read_answered)} for both stages (None where none ticked)."""
    return {stage: tick_figures(records[stage], start, end) for stage in trace.STAGES}
