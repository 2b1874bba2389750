"""The engine's thread: each pass frees, prefills, then ticks, so requests only ever queue work.

A pass closes conversations idle too long, releases the slots of ended ones, begins the prefill
of new ones and runs one chunk of a prefill under way, the prefills taking turns (a stage's
prefill sets its slots up in full: the talker plays the persona's prefill there, a transformer
pass a chunk; prefills.py), then ticks what the scheduler plans (scheduler.py), once it is due:
a conversation's frames wait for its prefill, the live ones' only for a chunk. Between ticks it
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
from ..core.thread_names import name_os_threads
from ..core.trace import FrameTrace, PrefillRecord
from .answers import finish
from .conversations import Conversation, ConversationTable
from .outbox import Outbox
from .prefills import PrefillJob
from .scheduler import SENDS_BEHIND_LIMIT_S, Scheduler
from .stage import Stage
from .stage_process import StageProcessDied
from .ticker import Ticker

log = logging.getLogger(__name__)

# Each prefill's log line, for people (core/trace.py records the same for programs).
PREFILLED_LOG = ("%s: prefilled %d conversation(s) in %.1f ms over %d chunk(s), the longest %.1f ms; %d live; "
                 "begun in %.1f ms, chunks %s ms")
HEARTBEAT_S = 1.0        # the loop wakes at least this often (heartbeat, idle conversations)
CANCEL_POLL_S = 0.5      # how often pending requests are asked whether their client is gone
BEHIND_WARNING_S = 10.0  # while the sends fall behind, the log says so at most this often


@dataclass
class _Prefill:
    """The prefill of the conversations admitted in one pass, under way."""
    conversations: list[Conversation]
    job: PrefillJob
    began: float
    begun_s: float  # `begin_prefills`: a round trip where the stage runs in a process of its own
    chunk_s: list[float] = field(default_factory=list)  # each chunk as the loop waited for it


class EngineLoop(threading.Thread):
    def __init__(self, name: str, stage: Stage, lock: threading.Condition, table: ConversationTable,
                 scheduler: Scheduler, ticker: Ticker, outbox: Outbox, fail: Callable[[Conversation, str, str], None],
                 stop_all: Callable[[str, str], None], metrics: Metrics, trace: FrameTrace,
                 idle_timeout_s: float | None):
        """`stage`, `lock` (over `table` and `running`), `fail(conversation, message, reason)`,
        `stop_all(message, reason)` and `idle_timeout_s`: the engine's (SlotEngine); `trace` records
        each prefill (core/trace.py)."""
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
        self.trace = trace
        self.idle_timeout_s = idle_timeout_s
        self.running = True  # under the lock: False ends the loop at its next pass
        self._prefills: list[_Prefill] = []
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
        """One pass of the loop: free, prefill, tick; False once shut down."""
        table = self._table
        with self._lock:
            due = self._scheduler.due_in()
            if self.running and not (table.to_prefill or self._chunk_due() or any(c.closable for c in table.all)) \
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
            admitted = table.take_prefilling()
            for conv in admitted:  # until its prefill is done (_finish_prefill): no tick carries it
                conv.prefilling = True
        for done in owed:
            finish(self.name, done, None)
        self._beat(now)
        self._poll_cancelled(now)
        if admitted:
            self._begin_prefill(admitted)
        if self._prefills:
            self._report_occupancy()  # the conversations admitted count as prefilling meanwhile
            self._advance_prefills()
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
            name_os_threads()  # those started since the last beat, for a per-thread read of the host's CPU
            behind = self._outbox.behind_s()
            self.metrics.sends_behind(behind)
            if behind > SENDS_BEHIND_LIMIT_S and now - self._last_behind_warning >= BEHIND_WARNING_S:
                self._last_behind_warning = now
                log.warning("%s: the answers leave %.2f s after their ticks: its %d send thread(s) cannot keep up "
                            "(a busy host?)", self.name, behind, self._outbox.lanes)

    def _poll_cancelled(self, now: float) -> None:
        """Ask each conversation's oldest pending request whether its client is gone (a client
        that goes cancels them all). A poll is a round trip to tritonserver: one a conversation,
        and none for a request about to be answered. Polling every pending request would make a
        backlog self-sustaining: under load thousands of frames may be pending, and their polls
        would slow the loop further."""
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
        """The gauges: conversations holding a slot, and of them the prefilling ones."""
        with self._lock:
            live = self._table.live()
            occupancy = (len(live), sum(conv.prefilling for conv in live))
        if occupancy != self._occupancy:
            self._occupancy = occupancy
            self.metrics.conversations(*occupancy)

    def _begin_prefill(self, admitted: list[Conversation]) -> None:
        """Begin the prefill of the conversations admitted since the last pass, together (one
        reset of the model for all), in the chunks of the stage's `begin_prefills`."""
        # Beginning does no work (a job's chunks run in `_advance_prefills`, which takes their failures).
        began = time.perf_counter()
        job = self.stage.begin_prefills({conv.slot: conv.setup for conv in admitted})
        self._prefills.append(_Prefill(admitted, job, began, time.perf_counter() - began))

    def _chunk_due(self) -> bool:
        """Whether the next prefill's next chunk may run now (scheduler.chunk_due); under the lock."""
        return bool(self._prefills) and self._scheduler.chunk_due(first=not self._prefills[0].chunk_s)

    def _advance_prefills(self) -> None:
        """One chunk of one prefill a pass, the prefills under way taking turns, so that a tick
        never waits for more than one chunk, and a prefill's later chunks spaced by the
        scheduler's ticks; a prefill done lets its conversations tick, and a conversation that
        cannot be prefilled ends with the reason, the others go on."""
        with self._lock:
            if not self._chunk_due():
                return
            self._scheduler.chunk_ran()
        prefill = self._prefills.pop(0)
        began = time.perf_counter()
        try:
            done, failed = prefill.job.advance(), prefill.job.failed
        except StageProcessDied:  # the engine stops (run)
            raise
        except Exception as exc:  # a bad persona must not take the engine down
            done, failed = True, {conv.slot: exc for conv in prefill.conversations}
        prefill.chunk_s.append(time.perf_counter() - began)
        if done:
            self._finish_prefill(prefill, failed)
        else:
            self._prefills.append(prefill)

    def _finish_prefill(self, prefill: _Prefill, failed: dict[int, Exception]) -> None:
        with self._lock:
            done = time.monotonic()
            for conv in prefill.conversations:
                conv.prefilling = False
                conv.answerable_from = done
            live = len(self._table.live())
        # The live conversations' frames waited for each chunk: the longest is what a prefill costs them.
        record = PrefillRecord(self.name, time.time(), len(prefill.conversations), time.perf_counter() - prefill.began,
                               prefill.begun_s, tuple(prefill.chunk_s), live)
        self.trace.prefill(record)
        log.info(PREFILLED_LOG, self.name, record.conversations, record.duration_s * 1e3, record.chunks,
                 record.longest_chunk_s * 1e3, live, record.begin_s * 1e3,
                 ", ".join(f"{chunk * 1e3:.1f}" for chunk in record.chunks_s))
        for conv in prefill.conversations:
            exc = failed.get(conv.slot)
            if exc is not None:
                log.error("prefilling conversation %s failed", conv.key, exc_info=exc)
                self._fail(conv, f"could not start the conversation: {exc}", reasons.INVALID_INPUT)
