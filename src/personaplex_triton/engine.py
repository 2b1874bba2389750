"""A background loop that advances a pool of conversation slots in lockstep ticks.

Both stages run on it: a stage owns per-slot model state and answers `tick(items)` with one
batched step; the engine's ConversationTable (conversations.py) maps conversations to slots,
queues each request's items and, each tick, hands each slot with items queued its next one. A
stage's `start` sets its slot up in full before its first tick (the talker plays the persona's
prefill there, on the engine thread). Requests only queue work (`execute()` returns at once);
answers go back through each request's callbacks, in order, from the engine's outbox thread
(outbox.py, answers.py): the next tick need not wait for the sends. Only one thread sends:
tritonserver 2.51 aborts when a Python-backend stub sends from several at once (a
boost::interprocess lock_exception).

Faults stay where they arise: a failing send ends that conversation; a failing tick ends the
conversation it names (`SlotFault`), else it is retried once and then ends the conversations
in it (ticker.py); the loop goes on. If the loop itself or the outbox's delivery dies, or the engine
shuts down, every pending request gets an error and `failure` says why (the model's health
signal).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Protocol

from . import metrics as reasons
from .answers import AnswerSender, finish
from .conversations import Conversation, ConversationError, ConversationTable, Request
from .faults import FaultPlan
from .metrics import Metrics
from .outbox import Outbox
from .ticker import Ticker
from .trace import FrameTrace

log = logging.getLogger(__name__)

__all__ = ["ConversationError", "SlotEngine", "Stage"]

HEARTBEAT_S = 1.0        # the loop wakes at least this often (heartbeat, idle conversations)
CANCEL_POLL_S = 0.5      # how often pending requests are asked whether their client is gone
SHUTDOWN_DRAIN_S = 5.0   # at shutdown, pending requests may finish this long before they get an error


class Stage(Protocol):
    num_slots: int

    def start(self, slot: int, setup: Any) -> None: ...
    def stop(self, slot: int) -> None: ...
    def tick(self, items: dict[int, Any]) -> dict[int, Any]: ...


class SlotEngine:
    def __init__(self, stage: Stage, name: str = "engine", evict_after_s: float | None = None,
                 idle_timeout_s: float | None = None, metrics: Metrics | None = None,
                 faults: FaultPlan | None = None):
        """`evict_after_s`: see ConversationTable (conversations.py). `idle_timeout_s`: a conversation with
        nothing pending for this long is closed (conversations can end without saying so: a
        client that vanishes, a sequence that Triton times out). `faults`: see faults.py."""
        self.stage = stage
        self.name = name
        self.idle_timeout_s = idle_timeout_s
        self.metrics = metrics or Metrics()
        self.trace = FrameTrace(name)
        self.failure: str | None = None  # why the engine cannot go on
        self._cond = threading.Condition()
        self._table = ConversationTable(stage.num_slots, evict_after_s)  # under self._cond
        self._running = True
        self._admitting = True
        self._last_cancel_poll = self._last_beat = 0.0
        self._occupancy: tuple[int, int] | None = None
        self.metrics.alive(True)  # from the start: the stage's load (warm personas) may have taken long
        sender = AnswerSender(name, self._cond, self._fail, self.metrics, self.trace, faults)
        self._outbox = Outbox(name, sender.deliver, lambda exc: self._stop_all(
            f"internal error: the {name} engine's answers stopped ({type(exc).__name__}: {exc})", reasons.UNAVAILABLE))
        self._ticker = Ticker(name, stage, self._cond, self._fail, self._outbox, self.metrics, faults)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.failure is None and self._thread.is_alive()

    # -- called from request threads -------------------------------------------------------
    def open(self, key: int, setup: Any, restart: bool = False) -> None:
        """Reserve a slot for a new conversation; its state is set up before the next tick.
        `restart`: an idle open conversation with this key starts over in its slot."""
        with self._cond:
            if self.failure is not None:
                raise ConversationError(self.failure, reasons.UNAVAILABLE)
            if not self._admitting:
                raise ConversationError("the server is shutting down; no new conversations", reasons.UNAVAILABLE)
            self._table.admit(key, setup, restart)
            self._cond.notify()

    def is_open(self, key: int) -> bool:
        with self._cond:
            return key in self._table.open

    def submit(self, key: int, items: list, on_output, on_done, close: bool = False,
               first_index: int | None = None, is_cancelled: Callable[[], bool] | None = None) -> None:
        """Queue items of conversation `key`; `close` ends it: its slot is freed once they are
        answered, and the key is free for a new conversation at once. An empty closing request
        is done once every earlier request of its conversation is. `first_index`: the index
        the first item must have in the conversation (a gap means a frame was lost: the
        conversation ends with an error). `is_cancelled`: polled while the request is pending;
        true ends the conversation (its client is gone)."""
        request = Request(list(items), on_output, on_done, is_cancelled)
        with self._cond:
            if self.failure is not None:
                raise ConversationError(self.failure, reasons.UNAVAILABLE)
            if not self._admitting and items:  # draining: what is pending finishes, nothing more starts
                raise ConversationError("the server is shutting down; no new requests", reasons.UNAVAILABLE)
            conv = self._table.conversation(key)
            lost, deferred = self._table.enqueue(conv, request, close, first_index)
            self._cond.notify()
        if lost is not None:
            self._fail(conv, lost, reasons.LOST_FRAME)
            raise ConversationError(lost, reasons.LOST_FRAME)
        if not request.items and not deferred:
            on_done(None)

    def open_keys(self) -> list[int]:
        with self._cond:
            return list(self._table.open)

    def shutdown(self, drain_s: float = SHUTDOWN_DRAIN_S) -> None:
        """Stop admitting conversations and requests with items; let pending requests finish
        for up to `drain_s`, then answer the rest with an error and stop the loop."""
        deadline = time.monotonic() + drain_s
        with self._cond:
            self._admitting = False
            # until every pending request is answered and every ended conversation released
            # (answers leave from the outbox, releases from the loop)
            while self._thread.is_alive() and self._table.owes_work() and time.monotonic() < deadline:
                self._cond.wait(0.1)
            self._running = False
            self._cond.notify_all()
        self._thread.join(timeout=10)
        self._stop_all("the server is shutting down", reasons.UNAVAILABLE)

    # -- the engine thread -----------------------------------------------------------------
    def _loop(self) -> None:
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
        with self._cond:
            if self._running and not (table.to_start or any(c.closable for c in table.all)
                                      or any(c.queue for c in table.live())):
                self._cond.wait(HEARTBEAT_S)
            if not self._running:
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
        for conv in starting:
            self._start(conv)
        with self._cond:
            batch = table.next_batch()
        if batch:
            self._ticker.tick(batch)
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
        with self._cond:
            oldest = [(c, c.requests[0]) for c in self._table.all if c.requests]
        for conv, request in oldest:
            if request.is_cancelled is not None and now - request.received >= CANCEL_POLL_S and request.cancelled():
                log.info("%s: conversation %s was cancelled by its client; freeing its slot", self.name, conv.key)
                self._fail(conv, "the request was cancelled", reasons.CANCELLED)

    def _report_occupancy(self, starting: int = 0) -> None:
        """The gauges: conversations holding a slot, and of them the `starting` ones (prefilling)."""
        with self._cond:
            occupancy = (len(self._table.live()), starting)
        if occupancy != self._occupancy:
            self._occupancy = occupancy
            self.metrics.conversations(*occupancy)

    def _start(self, conv: Conversation) -> None:
        try:
            self.stage.start(conv.slot, conv.setup)
        except Exception as exc:  # a bad persona must not take the engine down
            log.exception("starting conversation %s failed", conv.key)
            self._fail(conv, f"could not start the conversation: {exc}", reasons.INVALID_INPUT)

    def _fail(self, conv: Conversation, message: str, reason: str) -> None:
        """End a conversation: every request it still owes answers to gets the error."""
        with self._cond:
            owed = [r.finish for r in conv.requests]
            conv.queue.clear()
            conv.requests.clear()
            self._table.close(conv)
            owed += self._table.release(conv, self.stage.stop)
        for on_done in owed:
            self.metrics.rejected(reason)
            finish(self.name, on_done, message)

    def _stop_all(self, message: str, reason: str) -> None:
        """The engine cannot go on: every pending request gets `message`; nothing more is admitted."""
        with self._cond:
            self.failure = self.failure or message
            self._running = False
            conversations = list(self._table.all)
            self._table.open.clear()
        for conv in conversations:
            try:
                self._fail(conv, message, reason)
            except Exception:
                log.exception("%s: ending conversation %s failed", self.name, conv.key)
        self.metrics.alive(False)
