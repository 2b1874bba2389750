"""Threads that deliver a stage's answers, so the next tick need not wait for the sends.

A Python-backend model answers one response at a time: a large tick's sends take a good part
of a tick, time in which the GPU would sit idle. The engine puts each tick's
answers here and starts its next tick at once. Each lane (a thread) delivers the answers of its
own conversations (`lane_of`) in the order they were put, so a conversation's frames still
leave in order. A send is a round trip to tritonserver that releases the GIL while it waits,
and tritonserver takes the sends on a pool of threads (Python backend), so several lanes can
have sends in flight at once. A delivery that fails outside what it handles itself goes to
`on_failure`: the engine then errors every pending request, as when its own loop dies, so no
request waits in silence.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

log = logging.getLogger(__name__)


class _Lane:
    """One thread delivering the batches put to it, in order."""

    def __init__(self, name: str, deliver: Callable[[list], None], on_failure: Callable[[Exception], None]):
        self._deliver = deliver
        self._on_failure = on_failure
        self._batches: deque = deque()  # (when it was put, the batch)
        self._delivering_since: float | None = None  # when the batch being delivered was put
        self._cond = threading.Condition()
        self._open = True
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def put(self, batch: list) -> None:
        with self._cond:
            self._batches.append((time.monotonic(), batch))
            self._cond.notify_all()

    def behind_s(self, now: float) -> float:
        """How long the oldest batch not yet delivered has waited (0: none waits)."""
        with self._cond:
            since = self._delivering_since if self._delivering_since is not None else \
                (self._batches[0][0] if self._batches else None)
        return 0.0 if since is None else now - since

    def stop(self) -> None:
        """Deliver what was put, then end the thread."""
        with self._cond:
            self._open = False
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._batches and self._open:
                    self._cond.wait()
                if not self._batches:
                    return
                self._delivering_since, batch = self._batches.popleft()
            try:
                self._deliver(batch)
            except Exception as exc:
                log.exception("delivering answers failed")
                self._on_failure(exc)
            with self._cond:
                self._delivering_since = None


class Outbox:
    def __init__(self, name: str, deliver: Callable[[list], None], on_failure: Callable[[Exception], None],
                 lanes: int = 1, lane_of: Callable[[Any], int] = hash):
        """`deliver(answers)` is called on a lane's thread for each part of a batch put, in order;
        `on_failure(exc)` when it raises. `lanes` threads share the answers by `lane_of(answer)`
        (an int; answers that must leave in order need the same one)."""
        if lanes < 1:
            raise ValueError(f"an outbox needs at least one lane, got {lanes}")
        self._lane_of = lane_of
        self._lanes = [_Lane(f"{name}-outbox" + (f"-{i}" if lanes > 1 else ""), deliver, on_failure)
                       for i in range(lanes)]

    def put(self, batch: list) -> None:
        if len(self._lanes) == 1:
            self._lanes[0].put(batch)
            return
        parts: list[list] = [[] for _ in self._lanes]
        for answer in batch:
            parts[self._lane_of(answer) % len(parts)].append(answer)
        for lane, part in zip(self._lanes, parts):
            if part:
                lane.put(part)

    @property
    def lanes(self) -> int:
        return len(self._lanes)

    def behind_s(self) -> float:
        """How long the oldest answer not yet sent has waited, over the lanes: a tick's answers
        leave within tens of milliseconds while the sends keep up, and fall seconds behind when
        they cannot."""
        now = time.monotonic()
        return max(lane.behind_s(now) for lane in self._lanes)

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what was put, then stop the threads."""
        for lane in self._lanes:
            lane.stop()
        for lane in self._lanes:
            if threading.current_thread() is not lane.thread:
                lane.thread.join(timeout_s)
