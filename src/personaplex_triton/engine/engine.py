"""A pool of conversation slots that a background loop advances in lockstep ticks.

Both stages run on it: a stage owns per-slot model state and answers `tick(items)` with one
batched step. `SlotEngine` is what request threads call; they only queue work (`execute()`
returns at once). Its parts, as in vLLM's engine: ConversationTable (conversations.py) maps
conversations to slots and queues each request's items; the scheduler (scheduler.py) decides
what each tick carries and when it starts, and admits conversations by time; the loop
(engine_loop.py) frees, prefills and ticks on the engine's thread; the tick (ticker.py) steps
the stage; answers go back through each request's callbacks, in order,
from the outbox thread (outbox.py, answers.py), so the next tick need not wait for the sends.
`send_threads` gives the outbox lanes, each sending its own conversations' answers (the
models' default: several where the stage ticks in a process of its own, else 1;
core/tunables.py). A real tritonserver takes sends from several threads of one stub
(tests/test_integration.py; docs/decisions.md has the runs under load). The parts share
the engine's lock, and end a conversation through its `_fail`.

Faults stay where they arise: a failing send ends that conversation; a failing tick ends the
conversation it names (`SlotFault`), else it is retried once and then ends the conversations
in it; the loop goes on. If the loop itself or the outbox's delivery dies, or the engine
shuts down, every pending request gets an error and `failure` says why (the model's health
signal).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ..core import metrics as reasons
from ..core.fault_injection import FaultPlan
from ..core.metrics import Metrics
from ..core.trace import FrameTrace
from .answers import AnswerSender, finish
from .conversations import Conversation, ConversationError, ConversationTable, Request
from .engine_loop import EngineLoop
from .outbox import Outbox
from .scheduler import Scheduler
from .stage import Stage
from .ticker import Ticker

log = logging.getLogger(__name__)

__all__ = ["ConversationError", "SlotEngine", "Stage"]

SHUTDOWN_DRAIN_S = 5.0   # at shutdown, pending requests may finish this long before they get an error


class SlotEngine:
    def __init__(self, stage: Stage, name: str = "engine", evict_after_s: float | None = None,
                 idle_timeout_s: float | None = None, metrics: Metrics | None = None,
                 faults: FaultPlan | None = None, gather: Callable[[Any], tuple[int, int] | None] | None = None,
                 gather_max_s: float = 0.0, admission_tick_s: float = 0.0, admission_latency_s: float = 0.0,
                 chunk_spacing_ticks: int = 1, send_threads: int = 1,
                 downstream_behind_s: Callable[[], float] | None = None, admit_by_sends: bool = False):
        """`evict_after_s`: see ConversationTable (conversations.py). `idle_timeout_s`: a conversation with
        nothing pending for this long is closed (conversations can end without saying so: a
        client that vanishes, a sequence that Triton times out). `faults`: see core/fault_injection.py.
        `gather`, `gather_max_s`, `admission_tick_s`, `admission_latency_s`, `chunk_spacing_ticks`: the scheduler's (scheduler.py). `send_threads`: the outbox's lanes, each sending its own conversations'
        answers (outbox.py). `downstream_behind_s`: how far behind the sends of a later stage
        that these conversations' answers go through are (code2wav's: its `sends_behind_s` in one
        stub, serving/sends_gauge.py's reader in two),
        which admission counts with this engine's own. `admit_by_sends`: newcomers are refused
        while the sends fall behind (scheduler.SENDS_BEHIND_LIMIT_S); not in a later stage,
        whose conversations an earlier stage admitted."""
        self.stage = stage
        self.name = name
        self.metrics = metrics or Metrics()
        self.trace = FrameTrace(name)
        self.failure: str | None = None  # why the engine cannot go on
        self._cond = threading.Condition()
        self._table = ConversationTable(stage.num_slots, evict_after_s)  # under self._cond
        self.scheduler = Scheduler(self._table, gather, gather_max_s, admission_tick_s,  # under self._cond
                                   chunk_spacing_ticks, admission_latency_s)
        self._admitting = True
        self.metrics.alive(True)  # from the start: the stage's load (warm personas) may have taken long
        sender = AnswerSender(name, self._cond, self._fail, self.metrics, self.trace, faults,
                             on_answered=self.scheduler.answered)
        self._downstream_behind_s = downstream_behind_s or (lambda: 0.0)
        self._admit_by_sends = admit_by_sends
        self._outbox = outbox = Outbox(name, sender.deliver, lambda exc: self._stop_all(
            f"internal error: the {name} engine's answers stopped ({type(exc).__name__}: {exc})", reasons.UNAVAILABLE),
            lanes=send_threads, lane_of=lambda answer: answer.conversation.key)
        ticker = Ticker(name, stage, self._cond, self._fail, outbox, self.metrics, faults,
                        on_tick=self.scheduler.record, on_out_of_memory=self.scheduler.out_of_memory)
        self._loop = EngineLoop(name, stage, self._cond, self._table, self.scheduler, ticker, outbox, self._fail,
                                self._stop_all, self.metrics, self.trace, idle_timeout_s)
        self._loop.start()

    @property
    def healthy(self) -> bool:
        return self.failure is None and self._loop.is_alive()

    # -- called from request threads -------------------------------------------------------
    def open(self, key: int, setup: Any, restart: bool = False) -> None:
        """Reserve a slot for a new conversation; its state is set up before the next tick.
        `restart`: an idle open conversation with this key starts over in its slot."""
        # Read before taking the engine's lock, which the ticks wait for: a later stage's backlog
        # may be a file (serving/sends_gauge.py), and the outbox's lanes have locks of their own.
        behind = self.sends_behind_s() if self._admit_by_sends else 0.0
        with self._cond:
            if self.failure is not None:
                raise ConversationError(self.failure, reasons.UNAVAILABLE)
            if not self._admitting:
                raise ConversationError("the server is shutting down; no new conversations", reasons.UNAVAILABLE)
            if key not in self._table.open:
                late = self.scheduler.admission_error(len(self._table.live()), behind)
                if late is not None:
                    raise ConversationError(late, reasons.NO_FREE_SLOT)
            self._table.admit(key, setup, restart)
            self._cond.notify()

    @property
    def send_threads(self) -> int:
        return self._outbox.lanes

    def sends_behind_s(self) -> float:
        """How long the oldest answer not yet sent has waited, here or downstream."""
        return max(self._outbox.behind_s(), self._downstream_behind_s())

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
            while self._loop.is_alive() and self._table.owes_work() and time.monotonic() < deadline:
                self._cond.wait(0.1)
            self._loop.running = False
            self._cond.notify_all()
        self._loop.join(timeout=10)
        self._stop_all("the server is shutting down", reasons.UNAVAILABLE)

    # -- ending conversations, from any of the engine's threads ----------------------------
    def _fail(self, conv: Conversation, message: str, reason: str) -> None:
        """End a conversation: every request it still owes answers to gets the error."""
        with self._cond:
            owed = [r.finish for r in conv.requests]
            conv.queue.clear()
            conv.requests.clear()
            self._table.fail(conv, message)
            owed += self._table.release(conv, self.stage.stop)
        for on_done in owed:
            self.metrics.rejected(reason)
            finish(self.name, on_done, message)

    def _stop_all(self, message: str, reason: str) -> None:
        """The engine cannot go on: every pending request gets `message`; nothing more is admitted."""
        with self._cond:
            self.failure = self.failure or message
            self._loop.running = False
            conversations = list(self._table.all)
            self._table.open.clear()
        for conv in conversations:
            try:
                self._fail(conv, message, reason)
            except Exception:
                log.exception("%s: ending conversation %s failed", self.name, conv.key)
        self.metrics.alive(False)
