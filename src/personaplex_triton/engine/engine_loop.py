"""The engine's thread: each pass frees, starts, then ticks, so requests only ever queue work.

A pass closes conversations idle too long, releases the slots of ended ones, begins the start
of new ones and runs one piece of a start under way, the starts taking turns (a stage's start
sets its slot up in full: the talker plays the persona's prefill there, a chunk a piece;
starts.py), then ticks what the scheduler plans (scheduler.py), once it is due: a
conversation's frames wait for its start, the live ones' only for a piece. Between ticks it
beats (the model's health signal), asks pending requests whether their client is gone, and
keeps the occupancy gauges. If the loop itself dies, every pending request gets an error
(`stop_all`); however it ends, the outbox then delivers what it holds and stops.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..core import metrics as reasons
from ..core.metrics import Metrics
from .answers import finish
from .conversations import Conversation, ConversationTable
from .outbox import Outbox
from .scheduler import SENDS_BEHIND_LIMIT_S, Scheduler
from .stage import Stage
from .stage_process import StageProcessDied
from .starts import StartJob
from .ticker import Ticker

log = logging.getLogger(__name__)

# Each start's log line (serving.starts_in_log reads it back from tritonserver's log).
STARTED_LOG = ("%s: started %d conversation(s) in %.1f ms over %d piece(s), the longest %.1f ms; %d live; "
               "begun in %.1f ms, pieces %s ms")
HEARTBEAT_S = 1.0        # the loop wakes at least this often (heartbeat, idle conversations)
CANCEL_POLL_S = 0.5      # how often pending requests are asked whether their client is gone
BEHIND_WARNING_S = 10.0  # while the sends fall behind, the log says so at most this often


@dataclass
class _Start:
    """The start of the conversations admitted in one pass, under way."""
    conversations: list[Conversation]
    job: StartJob
    began: float
    begun_s: float  # `begin_starts`: a round trip where the stage runs in a process of its own
    piece_s: list[float] = field(default_factory=list)  # each piece as the loop waited for it

    @property
    def longest_s(self) -> float:
        """The longest piece: what the live conversations' frames waited for it."""
        return max(self.piece_s, default=0.0)


class EngineLoop(threading.Thread):
    def __init__(self, name: str, stage: Stage, lock: threading.Condition, table: ConversationTable,
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
        self._starts: list[_Start] = []
        self._last_cancel_poll = self._last_beat = 0.0
        self._last_behind_warning = -BEHIND_WARNING_S
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
            if self.running and not (table.to_start or self._piece_due() or any(c.closable for c in table.all)) \
                    and due != 0:
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
            for conv in starting:  # until its start is done (_finish_start): no tick carries it
                conv.starting = True
        for done in owed:
            finish(self.name, done, None)
        self._beat(now)
        self._poll_cancelled(now)
        if starting:
            self._begin(starting)
        if self._starts:
            self._report_occupancy()  # the conversations starting count as prefilling meanwhile
            self._advance_starts()
        with self._lock:
            plan = self._scheduler.schedule()
        if plan:
            self._ticker.tick(plan.items)
        self._report_occupancy()
        return True

    def _beat(self, now: float) -> None:
        if now - self._last_beat >= HEARTBEAT_S / 2:
            self._last_beat = now
            # a stage in a process of its own that died while idle: the engine stops (run)
            self.stage.raise_if_dead()
            self.metrics.alive(True)
            behind = self._outbox.behind_s()
            self.metrics.sends_behind(behind)
            if behind > SENDS_BEHIND_LIMIT_S and now - self._last_behind_warning >= BEHIND_WARNING_S:
                self._last_behind_warning = now
                log.warning("%s: the answers leave %.2f s after their ticks: its %d send thread(s) cannot keep up "
                            "(a busy host?)", self.name, behind, self._outbox.lanes)

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

    def _report_occupancy(self) -> None:
        """The gauges: conversations holding a slot, and of them the starting ones (prefilling)."""
        with self._lock:
            live = self._table.live()
            occupancy = (len(live), sum(conv.starting for conv in live))
        if occupancy != self._occupancy:
            self._occupancy = occupancy
            self.metrics.conversations(*occupancy)

    def _begin(self, starting: list[Conversation]) -> None:
        """Begin the start of the conversations admitted since the last pass, together (one
        reset of the model for all): in pieces where the stage has `begin_starts`, else at once."""
        # Beginning does no work (a job's pieces run in `_advance_starts`, which takes their failures).
        began = time.perf_counter()
        job = self.stage.begin_starts({conv.slot: conv.setup for conv in starting})
        self._starts.append(_Start(starting, job, began, time.perf_counter() - began))

    def _piece_due(self) -> bool:
        """Whether the next start's next piece may run now (scheduler.piece_due); under the lock."""
        return bool(self._starts) and self._scheduler.piece_due(first=not self._starts[0].piece_s)

    def _advance_starts(self) -> None:
        """One piece of one start a pass, the starts under way taking turns, so that a tick never
        waits for more than one piece, and a start's later pieces spaced by the scheduler's
        ticks; a start done lets its conversations tick, and one that cannot start ends with the
        reason, the others go on."""
        with self._lock:
            if not self._piece_due():
                return
            self._scheduler.piece_ran()
        start = self._starts.pop(0)
        began = time.perf_counter()
        try:
            done, failed = start.job.advance(), start.job.failed
        except StageProcessDied:  # the engine stops (run)
            raise
        except Exception as exc:  # a bad persona must not take the engine down
            done, failed = True, {conv.slot: exc for conv in start.conversations}
        start.piece_s.append(time.perf_counter() - began)
        if done:
            self._finish_start(start, failed)
        else:
            self._starts.append(start)

    def _finish_start(self, start: _Start, failed: dict[int, Exception]) -> None:
        with self._lock:
            for conv in start.conversations:
                conv.starting = False
            live = len(self._table.live())
        # The live conversations' frames waited for each piece: the longest is what a start costs them.
        log.info(STARTED_LOG, self.name, len(start.conversations), (time.perf_counter() - start.began) * 1e3,
                 len(start.piece_s), start.longest_s * 1e3, live, start.begun_s * 1e3,
                 ", ".join(f"{piece * 1e3:.1f}" for piece in start.piece_s))
        for conv in start.conversations:
            exc = failed.get(conv.slot)
            if exc is not None:
                log.error("starting conversation %s failed", conv.key, exc_info=exc)
                self._fail(conv, f"could not start the conversation: {exc}", reasons.INVALID_INPUT)
