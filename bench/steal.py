"""The host's CPU time while something ran (/proc/stat): how busy its cores were, and how much
of it the hypervisor gave to other guests ("steal").

On a shared VM a run's late frames often fall in a second when the host took the cores away;
sampling steal alongside a run says whether it did, and busy whether the cores were short
anyway.

    with StealSampler() as steal:
        run()
    steal.mean, steal.peak   # % of CPU time: over the run, and in its worst `interval_s`

CpuSampler keeps every interval's figures, for per-window figures along a run (window_figures).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

PROC_STAT = Path("/proc/stat")


class CpuTimes(NamedTuple):
    """Jiffies of all CPUs since boot: busy (all but idle and iowait, steal included), steal, and all."""
    busy: int
    steal: int
    total: int


def parse(stat: str) -> CpuTimes | None:
    """/proc/stat's text (its first line, "cpu user nice system idle iowait irq softirq steal ...");
    None where it says nothing of steal."""
    fields = stat.split("\n", 1)[0].split()
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    values = [int(v) for v in fields[1:9]]  # guest time, after steal, is already counted in user and nice
    total = sum(values)
    return CpuTimes(busy=total - values[3] - values[4], steal=values[7], total=total)


def cpu_times() -> CpuTimes | None:
    """This machine's CpuTimes now; None where /proc/stat says nothing of steal."""
    try:
        return parse(PROC_STAT.read_text())
    except OSError:
        return None


def _percent(part: int, total: int) -> float:
    return round(100 * part / total, 1) if total > 0 else 0.0


def steal_percent(before: CpuTimes, after: CpuTimes) -> float:
    return _percent(after.steal - before.steal, after.total - before.total)


def busy_percent(before: CpuTimes, after: CpuTimes) -> float:
    return _percent(after.busy - before.busy, after.total - before.total)


def interval(before: CpuTimes, after: CpuTimes, at: float) -> dict:
    """One interval's figures, placed at `at` (its middle): {"t", "busy_pct", "steal_pct"}."""
    return {"t": at, "busy_pct": busy_percent(before, after), "steal_pct": steal_percent(before, after)}


def window_figures(samples: list[dict], start: float, end: float) -> dict | None:
    """Over the intervals (CpuSampler.samples) whose middle falls in [start, end): how many, and the
    median and highest busy and steal %; None without any there."""
    inside = [s for s in samples if start <= s["t"] < end]
    if not inside:
        return None
    found = {"samples": len(inside)}
    for name in ("busy_pct", "steal_pct"):
        values = [s[name] for s in inside]
        found[name] = round(float(np.median(values)), 1)
        found[f"{name}_max"] = max(values)
    return found


class CpuSampler:
    """Context manager: /proc/stat every `interval_s` while in the block; `samples` then holds each
    interval's figures (interval()), and `whole` the block's. Where the kernel does not report
    steal it samples nothing."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self.whole: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._first_at, self._first = time.time(), cpu_times()
        if self._first is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._first is None:
            return
        self._stop.set()
        self._thread.join()
        self.whole = interval(self._first, cpu_times(), (self._first_at + time.time()) / 2)

    def _sample(self) -> None:
        last_at, last = self._first_at, self._first
        while not self._stop.wait(self.interval_s):
            at, now = time.time(), cpu_times()
            self.samples.append(interval(last, now, (last_at + at) / 2))
            last_at, last = at, now


class StealSampler(CpuSampler):
    """Steal over the block (`mean`) and its worst `interval_s` window (`peak`), once it is over;
    both None where the kernel does not report steal."""

    @property
    def mean(self) -> float | None:
        return None if self.whole is None else self.whole["steal_pct"]

    @property
    def peak(self) -> float | None:
        return None if self.whole is None else max((s["steal_pct"] for s in self.samples), default=0.0)
