"""The engine's thread: each pass frees, starts, then ticks, so requests only ever queue work.

A pass closes conversations idle too long, releases the slots of ended ones, starts new ones
(a stage's start sets its slot up in full: the talker plays the persona's prefill there), then
ticks what the scheduler plans (scheduler.py), once it is due. Between ticks it beats (the model's health signal), asks
pending requests whether their client is gone, and keeps the occupancy gauges. If the loop
itself dies, every pending request gets an error (`stop_all`); however it ends, the outbox then
delivers what it holds and stops.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..core import metrics as reasons
from ..core.metrics import Metrics
from .answers import finish
from .conversations import Conversation, ConversationTable
from .outbox import Outbox
from .scheduler import Scheduler
from .ticker import Ticker

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0        # the loop wakes at least this often (heartbeat, idle conversations)
CANCEL_POLL_S = 0.5      # how often pending requests are asked whether their client is gone


class EngineLoop(threading.Thread):
    def __init__(self, name: str, stage, lock: threading.Condition, table: ConversationTable,
                 scheduler: Scheduler, ticker: Ticker, outbox: Outbox, fail: Callable[[Conversation, str, str], None],
                 stop_all: Callable[[str, str], None], metrics: Metrics, idle_timeout_s: float | None):
        """`stage`, `lock` (over `table` and `running`), `fail(conversation, message, reason)`,
        `stop_all(message, reason)` and `idle_timeout_s`: the engine's (SlotEngine)."""
        super().__init__(name=name, daemon=True)
        self.stage = stage
        self._lock = lock
        self._table = table
        self._scheduler = scheduler
        self._ticker = ticker
        self._outbox = outbox
        self._fail = fail
        self._stop_all = stop_all
        self.metrics = metrics
        self.idle_timeout_s = idle_timeout_s
        self.running = True  # under the lock: False ends the loop at its next pass
        self._last_cancel_poll = self._last_beat = 0.0
        self._occupancy: tuple[int, int] | None = None

    def run(self) -> None:
        try:
            while self._pass():
                pass
        except BaseException as exc:  # the loop must never die silently
            log.exception("%s: the engine loop failed", self.name)
            self._stop_all(f"internal error: the {self.name} engine stopped ({type(exc).__name__}: {exc})",
                           reasons.UNAVAILABLE)
        finally:
            self._outbox.close()

    def _pass(self) -> bool:
        """One pass of the loop: free, start, tick; False once shut down."""
        table = self._table
        with self._lock:
            due = self._scheduler.due_in()
            if self.running and not (table.to_start or any(c.closable for c in table.all)) and due != 0:
                self._lock.wait(HEARTBEAT_S if due is None else due)
            if not self.running:
                return False
            now = time.monotonic()
            if self.idle_timeout_s is not None:
                for conv in table.close_idle(now, self.idle_timeout_s):
                    log.info("%s: conversation %s idle for %.0f s; closing it", self.name, conv.key,
                             now - conv.last_active)
            owed = [done for conv in [c for c in table.all if c.closable]
                    for done in table.release(conv, self.stage.stop)]
            starting = table.take_starting()
        for done in owed:
            finish(self.name, done, None)
        self._beat(now)
        self._poll_cancelled(now)
        if starting:  # a stage's start plays the persona's prefill: count those as prefilling meanwhile
            self._report_occupancy(starting=len(starting))
        if starting:
            self._start(starting)
        with self._lock:
            plan = self._scheduler.schedule()
        if plan:
            self._ticker.tick(plan.items)
        self._report_occupancy()
        return True

    def _beat(self, now: float) -> None:
        if now - self._last_beat >= HEARTBEAT_S / 2:
            self._last_beat = now
            self.metrics.alive(True)

    def _poll_cancelled(self, now: float) -> None:
        """Ask each conversation's oldest pending request whether its client is gone (a client
        that goes cancels them all). A poll is a round trip to tritonserver: one a conversation,
        and none for a request about to be answered. Polling every pending request made a
        backlog self-sustaining on the H200: at 64 conversations thousands of frames were
        pending, and their polls slowed the loop further."""
        if now - self._last_cancel_poll < CANCEL_POLL_S:
            return
        self._last_cancel_poll = now
        with self._lock:
            oldest = [(c, c.requests[0]) for c in self._table.all if c.requests]
        for conv, request in oldest:
            if request.is_cancelled is not None and now - request.received >= CANCEL_POLL_S and request.cancelled():
                log.info("%s: conversation %s was cancelled by its client; freeing its slot", self.name, conv.key)
                self._fail(conv, "the request was cancelled", reasons.CANCELLED)

    def _report_occupancy(self, starting: int = 0) -> None:
        """The gauges: conversations holding a slot, and of them the `starting` ones (prefilling)."""
        with self._lock:
            occupancy = (len(self._table.live()), starting)
        if occupancy != self._occupancy:
            self._occupancy = occupancy
            self.metrics.conversations(*occupancy)

    def _start(self, starting: list[Conversation]) -> None:
        """Start the conversations admitted since the last pass together (one reset of the
        model for all); one that cannot start ends with the reason, the others go on."""
        began = time.perf_counter()
        try:
            failed = self.stage.start_many({conv.slot: conv.setup for conv in starting})
        except Exception as exc:  # a bad persona must not take the engine down
            failed = {conv.slot: exc for conv in starting}
        # The live conversations' frames wait for it: a new persona's prefill is the longest.
        with self._lock:
            live = len(self._table.live())
        log.info("%s: started %d conversation(s) in %.1f ms, %d live", self.name, len(starting),
                 (time.perf_counter() - began) * 1e3, live)
        for conv in starting:
            exc = failed.get(conv.slot)
            if exc is not None:
                log.error("starting conversation %s failed", conv.key, exc_info=exc)
                self._fail(conv, f"could not start the conversation: {exc}", reasons.INVALID_INPUT)
