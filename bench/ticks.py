"""Each stage's ticks over a stretch of a run, from the stages' frame traces (core/trace.py):
how many ran a second, how many frames each carried, and the stage's busy fraction (its ticks'
summed duration over the wall time). A stage that ticks often with few frames a tick is busy
without carrying more: these say which. And how long the ticks spent off the CPU (their wall
time less their thread's CPU time; a GPU wait spins, so this is waiting for the GIL or a lock),
over all ticks and over the slowest 1%: whether the slow ones wait on the host or on the GPU."""

from __future__ import annotations

import numpy as np

from personaplex_triton.core import trace


def tick_table(records: list[dict]) -> dict[str, np.ndarray]:
    """A stage's ticks from its frame records (one per frame a tick carried), in order of start:
    start and end (s), frames carried, rows stepped, the last answer's send (s), and the time
    off the CPU (ms: the tick's wall time less its thread's CPU time; NaN where the trace does
    not keep the CPU time)."""
    ticks: dict[float, list] = {}  # by start: [end, frames, rows, last send, CPU seconds]
    for r in records:
        tick = ticks.setdefault(r["tick_start"], [r["tick_end"], 0, r["rows"], r["sent"], r.get("tick_cpu", np.nan)])
        tick[1] += 1
        tick[3] = max(tick[3], r["sent"])
    starts = np.array(sorted(ticks), dtype=np.float64)
    end, frames, rows, last_sent, cpu = (np.array([ticks[s][i] for s in starts], dtype=np.float64)
                                         for i in range(5))
    return {"start": starts, "end": end, "frames": frames, "rows": rows, "last_sent": last_sent,
            "off_cpu_ms": 1000 * np.maximum(end - starts - cpu, 0.0)}


def tick_figures(records: list[dict], start: float, end: float) -> dict | None:
    """The ticks that started in [start, end) (wall-clock seconds) among a stage's frame records
    (one per frame a tick carried): ticks, ticks per second, frames per tick (mean, p50, max),
    rows stepped (p50), tick time (p50, p99 ms), the busy fraction, and the time off the CPU
    (p50, p99 ms, and the p50 over the ticks at or above the p99 tick time; None from traces
    that do not keep the tick's CPU time); None if there were none."""
    if end <= start:
        raise ValueError(f"the stretch must end after it starts: {start} to {end}")
    inside = [record for record in records if start <= record["tick_start"] < end]
    if not inside:
        return None
    t = tick_table(inside)
    seconds, frames, off_cpu = t["end"] - t["start"], t["frames"], t["off_cpu_ms"]
    wall = end - start
    slowest = seconds >= np.percentile(seconds, 99)
    traced_cpu = not np.isnan(off_cpu).any()
    return {"ticks": len(seconds), "ticks_per_s": round(len(seconds) / wall, 2),
            "frames_per_tick_mean": round(float(frames.mean()), 2), "frames_per_tick_p50": float(np.median(frames)),
            "frames_per_tick_max": int(frames.max()), "rows_p50": float(np.median(t["rows"])),
            "tick_ms_p50": round(1000 * float(np.median(seconds)), 2),
            "tick_ms_p99": round(1000 * float(np.percentile(seconds, 99)), 2),
            "busy_fraction": round(float(seconds.sum()) / wall, 3),
            "off_cpu_ms_p50": round(float(np.median(off_cpu)), 2) if traced_cpu else None,
            "off_cpu_ms_p99": round(float(np.percentile(off_cpu, 99)), 2) if traced_cpu else None,
            "slowest_off_cpu_ms_p50": round(float(np.median(off_cpu[slowest])), 2) if traced_cpu else None}


def stage_ticks(records: dict[str, list[dict]], start: float, end: float) -> dict:
    """{stage: tick_figures of its `records` (trace.read_answered)} for both stages (None where none ticked)."""
    return {stage: tick_figures(records[stage], start, end) for stage in trace.STAGES}



def during(records: list[dict], start: float, end: float, gap_ms: float = 1.0) -> dict:
    """A stage's ticks over a span (wall-clock seconds; a start's, whose pieces ran between
    them), from the last tick that ended by `start` to the first that started after `end`: each
    tick's time, and each gap over `gap_ms` between one tick's end and the next's start, in order
    (ms). A piece the stage waited for shows as a gap (as does a stretch with no frame waiting);
    one whose GPU work it did not wait for shows in the next tick, which runs long."""
    t = tick_table([r for r in records if start - 1.0 <= r["tick_start"] <= end + 1.0])
    first = max(int(np.searchsorted(t["end"], start, side="right")) - 1, 0)
    last = int(np.searchsorted(t["start"], end, side="right")) + 1
    begins, ends = t["start"][first:last], t["end"][first:last]
    gaps = 1000 * (begins[1:] - ends[:-1])
    return {"ticks_ms": [round(float(ms), 1) for ms in 1000 * (ends - begins)],
            "gaps_ms": [round(float(ms), 1) for ms in gaps if ms > gap_ms]}
