"""A noisy host that any host reproduces: the server's processes frozen now and then, and cores
kept busy, during a load level.

A hypervisor that steals a guest's CPU stops all of it for a while; SIGSTOP of every process
of the server's tree for D ms every P ms does the same to the server alone (`Freezer`, a thread
of the load generator's process, on an absolute schedule). `Freezer.once` freezes once, so
that the level shows how long the server takes to answer in time again (stats.recovery_s).
`Burners` keep K cores busy with spinning processes, as noisy neighbours do.

    with Freezer(pids, freeze_ms=20, period_ms=1000), Burners(2, cpus):
        run_level()
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass


def parse_noise(text: str) -> tuple[float, float]:
    """"D/P" (ms frozen every ms) -> (D, P), with 0 < D < P."""
    freeze, _, period = text.partition("/")
    try:
        d, p = float(freeze), float(period)
    except ValueError:
        raise ValueError(f"--host-noise {text!r}: expected D/P in ms, e.g. 20/1000") from None
    if not 0 < d < p:
        raise ValueError(f"--host-noise {text!r}: needs 0 < D < P")
    return d, p


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


class Hold:
    """The processes' stop, shared by the freezers of one level: they stay stopped while any of
    them freezes (a short periodic freeze that ends inside a long single one must not continue
    the processes before the long one ends)."""

    def __init__(self, pids: list[int]):
        self.pids = list(pids)
        self._holders = 0
        self._lock = threading.Lock()

    def stop(self) -> None:
        with self._lock:
            self._holders += 1
            if self._holders == 1:
                _signal_all(self.pids, signal.SIGSTOP)

    def release(self) -> None:
        with self._lock:
            self._holders = max(0, self._holders - 1)
            if self._holders == 0:
                _signal_all(self.pids, signal.SIGCONT)


class Freezer:
    """Context manager: a thread that stops `pids` (SIGSTOP) for `freeze_ms` every `period_ms`
    while in the block, the first freeze one period in; or, with `once_at_s`, a single freeze
    that many seconds in. `freezes` holds each freeze's (start, end) wall-clock times. Freezers
    of the same processes share a `hold`. Leaving the block always continues every process
    (SIGCONT) its freezes stopped, whatever happened."""

    def __init__(self, pids: list[int], freeze_ms: float, period_ms: float | None = None,
                 once_at_s: float | None = None, hold: Hold | None = None):
        if (period_ms is None) == (once_at_s is None):
            raise ValueError("a Freezer freezes every period_ms or once_at_s, one of the two")
        self.hold = hold or Hold(pids)
        self.pids, self.freeze_s = list(pids), freeze_ms / 1000
        self.period_s = None if period_ms is None else period_ms / 1000
        self.once_at_s = once_at_s
        self.freezes: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="freezer")

    @classmethod
    def once(cls, pids: list[int], freeze_ms: float, at_s: float, hold: Hold | None = None) -> Freezer:
        return cls(pids, freeze_ms, once_at_s=at_s, hold=hold)

    def __enter__(self) -> Freezer:
        self._began = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        _signal_all(self.pids, signal.SIGCONT)

    def _run(self) -> None:
        due = self._began + (self.once_at_s if self.period_s is None else self.period_s)
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            self._freeze()
            if self.period_s is None:
                return
            while due <= time.monotonic():  # a freeze that overran its period skips the freezes it covered
                due += self.period_s

    def _freeze(self) -> None:
        start = time.time()
        self.hold.stop()
        try:
            self._stop.wait(self.freeze_s)  # leaving the block ends a freeze at once
        finally:
            self.hold.release()
            self.freezes.append((start, time.time()))


class Burners:
    """Context manager: `count` processes that each spin a core while in the block (on `cpus`,
    where given), ended on leaving it."""

    def __init__(self, count: int, cpus: list[int] | None = None):
        self.count, self.cpus = count, cpus
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> Burners:
        pin = None if self.cpus is None else (lambda: os.sched_setaffinity(0, self.cpus))
        for _ in range(self.count):
            self.processes.append(subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin))
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.wait()


@dataclass(frozen=True)
class Noise:
    """The noise of each load level: `every` (D ms frozen, every P ms), `burn_cores` spinning
    processes (on `burn_cpus` where given), and `freeze_once_ms`: one freeze mid-level."""
    every: tuple[float, float] | None = None
    burn_cores: int = 0
    burn_cpus: tuple[int, ...] | None = None
    freeze_once_ms: float | None = None

    def header(self) -> dict:
        return {"freeze_ms_every_ms": list(self.every) if self.every else None, "burn_cores": self.burn_cores,
                "burn_cpus": list(self.burn_cpus) if self.burn_cpus else None, "freeze_once_ms": self.freeze_once_ms}

    @contextlib.contextmanager
    def during(self, pids: list[int], level_s: float):
        """The noise over a level of `level_s` seconds on the server's `pids`: yields the
        freezers that ran, {"every": Freezer, "once": Freezer} (those asked for)."""
        with contextlib.ExitStack() as stack:
            freezers = {}
            if self.burn_cores:
                stack.enter_context(Burners(self.burn_cores, list(self.burn_cpus) if self.burn_cpus else None))
            hold = Hold(pids)
            if self.every:
                freezers["every"] = stack.enter_context(Freezer(pids, self.every[0], period_ms=self.every[1],
                                                                hold=hold))
            if self.freeze_once_ms:
                freezers["once"] = stack.enter_context(Freezer.once(pids, self.freeze_once_ms, level_s / 2, hold))
            yield freezers
