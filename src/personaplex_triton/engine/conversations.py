"""A stage's conversations: which slot each holds, what it has queued, what it still owes.

`ConversationTable` admits conversations (evicting an idle one when every slot is taken),
queues their requests' items and frees slots; the scheduler (scheduler.py) picks each tick's
items from its queues. It is plain data, not thread-safe: the engine (engine.py,
engine_loop.py) calls it under its lock, and calls the stage and the requests' callbacks outside it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..core import metrics as reasons

log = logging.getLogger(__name__)

# How many ended-with-an-error conversations keep their error for a later request of theirs.
FAILURES_KEPT = 1024


class ConversationError(ValueError):
    """A request that cannot be served (no free slot, unknown or duplicate conversation, a
    lost frame, shutting down); `reason` labels it in the metrics."""

    def __init__(self, message: str, reason: str = reasons.NOT_OPEN):
        super().__init__(message)
        self.reason = reason


@dataclass
class Request:
    items: list
    # (output, its index in the conversation, whether it is the request's last), in order: the
    # last output's response also completes the request (Triton: one response, not two)
    on_output: Callable[[Any, int, bool], None]
    on_done: Callable[[str | None], None]  # called once, with an error message or None
    is_cancelled: Callable[[], bool] | None = None
    received: float = field(default_factory=time.monotonic)
    answered: int = 0
    finished: bool = False
    # Sends, the final answer and cancellation polls come from different threads; once Triton
    # has a request's final response it frees the request, so none may follow it.
    guard: threading.Lock = field(default_factory=threading.Lock)

    def send(self, output: Any, index: int, last: bool) -> bool:
        """Send one output; `last` finishes the request with it. False if it was already finished."""
        with self.guard:
            if self.finished:
                return False
            self.on_output(output, index, last)
            if last:
                self.finished = True
                self.on_done(None)
            return True

    def finish(self, error: str | None) -> None:
        with self.guard:
            if not self.finished:
                self.finished = True
                self.on_done(error)

    def cancelled(self) -> bool:
        """Whether the client is gone. A poll that fails says no: the request's next send
        fails too if the client is, and ends its conversation alone."""
        with self.guard:
            if self.finished or self.is_cancelled is None:
                return False
            try:
                return bool(self.is_cancelled())
            except Exception:
                log.warning("asking whether a request was cancelled failed; taking it as not", exc_info=True)
                return False


@dataclass
class Conversation:
    key: int
    setup: Any
    slot: int | None = None
    queue: deque = field(default_factory=deque)     # (request, item, queued at) not yet ticked
    requests: list = field(default_factory=list)    # requests not yet done
    closing: bool = False
    answered: int = 0   # items answered so far, over all its requests
    submitted: int = 0  # items queued so far, over all its requests
    last_active: float = field(default_factory=time.monotonic)
    # The earliest its next frame could be answered (time.monotonic): its prefill's end, then its
    # last answer's send (answers.py).
    answerable_from: float = 0.0
    on_released: list = field(default_factory=list)  # on_done of an empty closing request, owed at release
    prefilling: bool = False  # its stage's prefill is under way, in chunks between ticks (engine_loop.py)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.requests

    @property
    def closable(self) -> bool:
        """Its slot can be freed: nothing owed, and no prefill still writing into the slot."""
        return self.closing and self.idle and not self.prefilling


class ConversationTable:
    def __init__(self, num_slots: int, evict_after_s: float | None = None):
        """`evict_after_s`: when every slot is taken, a new conversation replaces the one idle
        the longest, if idle for at least that long."""
        self.num_slots = num_slots
        self.evict_after_s = evict_after_s
        self.open: dict[int, Conversation] = {}  # by key: those that take more requests
        self.all: list[Conversation] = []        # every conversation holding or awaiting a slot
        self.to_prefill: deque[Conversation] = deque()
        self._free = list(range(num_slots))
        # Why recent conversations ended with an error, by key: a request of theirs that comes
        # after it (or is answered before it: answers of different requests race) names it.
        self._failures: OrderedDict[int, str] = OrderedDict()

    def admit(self, key: int, setup: Any, restart: bool) -> None:
        """A new conversation, to prefill before the next tick (see SlotEngine.open)."""
        conv = self.open.get(key)
        if conv is not None:
            if not (restart and conv.idle):
                raise ConversationError(f"conversation {key} is already open", reasons.INVALID_INPUT)
            conv.setup = setup
            conv.answered = conv.submitted = 0
            self.to_prefill.append(conv)
            return
        if len(self.all) >= self.num_slots and self.evict_after_s is not None:
            since = time.monotonic() - self.evict_after_s
            idle = [c for c in self.open.values() if c.idle and c.last_active <= since]
            if idle:
                self.close(min(idle, key=lambda c: c.last_active))
        if len(self.all) - sum(c.closable for c in self.all) >= self.num_slots:
            raise ConversationError(
                f"at capacity: all {self.num_slots} conversation slots are busy; try again later",
                reasons.NO_FREE_SLOT)
        conv = Conversation(key, setup)
        self._failures.pop(key, None)
        self.open[key] = conv
        self.all.append(conv)
        self.to_prefill.append(conv)

    def conversation(self, key: int) -> Conversation:
        conv = self.open.get(key)
        if conv is None and key in self._failures:
            raise ConversationError(f"conversation {key} is not open: it ended with an error: {self._failures[key]}")
        if conv is None:
            raise ConversationError(
                f"conversation {key} is not open (its start request failed, was never sent, it "
                "ended, or it was idle too long)")
        return conv

    def enqueue(self, conv: Conversation, request: Request, close: bool, first_index: int | None) -> tuple:
        """Queue a request's items: (the lost-frame message if `first_index` is not the frame
        due, which marks the conversation closing; whether the request is an empty closing one
        that is answered at its conversation's release)."""
        if first_index is not None and first_index != conv.submitted:
            conv.closing = True
            return (f"frame {first_index} of conversation {conv.key} arrived where frame {conv.submitted} "
                    "was due: a frame was lost or repeated; the conversation ends"), False
        queued = time.time()  # wall clock, for the frame trace
        conv.queue.extend((request, item, queued) for item in request.items)
        conv.submitted += len(request.items)
        conv.last_active = time.monotonic()
        deferred = False
        if request.items:
            conv.requests.append(request)
        elif close and not conv.idle:
            conv.on_released.append(request.on_done)
            deferred = True
        if close:
            self.close(conv)
        return None, deferred

    def close(self, conv: Conversation) -> None:
        """No more requests: its key is free at once, its slot once what it owes is answered."""
        conv.closing = True
        if self.open.get(conv.key) is conv:
            del self.open[conv.key]

    def fail(self, conv: Conversation, message: str) -> None:
        """Close a conversation that ended with the error `message`, kept for its later requests."""
        if self.open.get(conv.key, conv) is conv:  # not once its key is another conversation's
            self._failures[conv.key] = message
            self._failures.move_to_end(conv.key)
            if len(self._failures) > FAILURES_KEPT:
                self._failures.popitem(last=False)
        self.close(conv)

    def close_idle(self, now: float, idle_timeout_s: float) -> list[Conversation]:
        """Close the open conversations with nothing pending for `idle_timeout_s`; returns them."""
        idle = [c for c in self.open.values() if c.idle and now - c.last_active > idle_timeout_s]
        for conv in idle:
            self.close(conv)
        return idle

    def release(self, conv: Conversation, stop: Callable[[int], None]) -> list:
        """Free the conversation's slot (`stop(slot)` clears the stage's state); returns the
        callbacks owed at its release."""
        if conv.slot is not None:
            try:
                stop(conv.slot)
            finally:
                self._free.append(conv.slot)
                conv.slot = None
        if conv in self.to_prefill:
            self.to_prefill.remove(conv)
        if conv in self.all:
            self.all.remove(conv)
        owed, conv.on_released = conv.on_released, []
        return owed

    def take_prefilling(self) -> list[Conversation]:
        """The conversations to prefill, each given the lowest free slot (any would do: a tick's
        rows reach their slots through a slot table)."""
        admitted = list(self.to_prefill)
        self.to_prefill.clear()
        for conv in admitted:
            if conv.slot is None:
                conv.slot = min(self._free)
                self._free.remove(conv.slot)
        return admitted

    def live(self) -> list[Conversation]:
        """The conversations holding a slot, started or starting."""
        return [c for c in self.all if c.slot is not None]

    def ready(self) -> list[Conversation]:
        """The conversations a tick may carry: holding a slot, their prefill done."""
        return [c for c in self.all if c.slot is not None and not c.prefilling]

    def owes_work(self) -> bool:
        """Whether some conversation still owes answers or a release (shutdown waits for none)."""
        return any(c.requests or c.closing for c in self.all)
