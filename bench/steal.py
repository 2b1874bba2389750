"""CPU time the hypervisor gave to other guests ("steal", /proc/stat) while something ran.

On a shared VM a run's late frames often fall in a second when the host took the cores away;
sampling steal alongside a run says whether it did.

    with StealSampler() as steal:
        run()
    steal.mean, steal.peak   # % of CPU time: over the run, and in its worst `interval_s`
"""

from __future__ import annotations

import threading
from pathlib import Path

PROC_STAT = Path("/proc/stat")


def cpu_times() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs since boot; None where /proc/stat says nothing of steal."""
    try:
        fields = PROC_STAT.read_text().splitlines()[0].split()
    except OSError:
        return None
    if fields[0] != "cpu" or len(fields) < 9:
        return None
    values = [int(v) for v in fields[1:]]
    return values[7], sum(values[:8])  # user nice system idle iowait irq softirq steal


def steal_percent(before: tuple[int, int], after: tuple[int, int]) -> float:
    total = after[1] - before[1]
    return round(100 * (after[0] - before[0]) / total, 1) if total > 0 else 0.0


class StealSampler:
    """Context manager: steal over the block (`mean`) and its worst `interval_s` window (`peak`);
    both None where the kernel does not report steal."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.mean: float | None = None
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "StealSampler":
        self._start = cpu_times()
        if self._start is not None:
            self.peak = 0.0
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._start is None:
            return
        self._stop.set()
        self._thread.join()
        self.mean = steal_percent(self._start, cpu_times())

    def _sample(self) -> None:
        last = self._start
        while not self._stop.wait(self.interval_s):
            now = cpu_times()
            self.peak = max(self.peak, steal_percent(last, now))
            last = now
