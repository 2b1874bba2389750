"""A thread that delivers a stage's answers, so the next tick need not wait for the sends.

A Python-backend model answers one response at a time: at 64 conversations a talker tick's 64
sends took 13 ms on the H200, time in which the GPU sat idle. The engine puts each tick's
answers here and starts its next tick at once; this thread delivers them in the order they
were put, so a conversation's frames still leave in order. A delivery that fails outside what
it handles itself goes to `on_failure`: the engine then errors every pending request, as when
its own loop dies, so no request waits in silence.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable

log = logging.getLogger(__name__)


class Outbox:
    def __init__(self, name: str, deliver: Callable[[Any], None], on_failure: Callable[[Exception], None]):
        """`deliver(batch)` is called on the outbox's thread for each batch put, in order;
        `on_failure(exc)` when it raises."""
        self._deliver = deliver
        self._on_failure = on_failure
        self._batches: deque = deque()
        self._cond = threading.Condition()
        self._open = True
        self._thread = threading.Thread(target=self._loop, name=f"{name}-outbox", daemon=True)
        self._thread.start()

    def put(self, batch: Any) -> None:
        with self._cond:
            self._batches.append(batch)
            self._cond.notify_all()

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what was put, then stop the thread."""
        with self._cond:
            self._open = False
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._batches and self._open:
                    self._cond.wait()
                if not self._batches:
                    return
                batch = self._batches.popleft()
            try:
                self._deliver(batch)
            except Exception as exc:
                log.exception("delivering answers failed")
                self._on_failure(exc)
