"""A background loop that advances a pool of conversation slots in lockstep ticks.

Both stages run on it: a stage owns per-slot model state and answers `tick(items)` with one
batched step; the engine maps conversations to slots, queues each request's items and, each
tick, hands every slot at most one item (slots still prefilling tick without one). Requests
only queue work (`execute()` returns at once); answers go back through each request's
callbacks, from the engine's thread, in order.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from .trace import FrameTrace

log = logging.getLogger(__name__)


class ConversationError(ValueError):
    """A request that cannot be served (no free slot, unknown or duplicate conversation)."""


class Stage(Protocol):
    num_slots: int

    def start(self, slot: int, setup: Any) -> None: ...
    def stop(self, slot: int) -> None: ...
    def prefilling(self, slot: int) -> bool: ...
    def tick(self, items: dict[int, Any]) -> dict[int, Any]: ...


@dataclass
class _Request:
    items: list
    on_output: Callable[[Any, int], None]  # (output, its index in the conversation), in order
    on_done: Callable[[str | None], None]  # called once, with an error message or None
    answered: int = 0


@dataclass
class _Conversation:
    key: int
    setup: Any
    slot: int | None = None
    queue: deque = field(default_factory=deque)     # (request, item, queued at) not yet ticked
    requests: list = field(default_factory=list)    # requests not yet done
    closing: bool = False
    answered: int = 0  # items answered so far, over all its requests
    last_active: float = field(default_factory=time.monotonic)


class SlotEngine:
    def __init__(self, stage: Stage, name: str = "engine", evict_after_s: float | None = None):
        """`evict_after_s`: when every slot is taken, a new conversation replaces the one idle
        the longest, if idle for at least that long (conversations can end without saying so:
        a client that vanishes, a sequence that Triton times out)."""
        self.stage = stage
        self.evict_after_s = evict_after_s
        self.trace = FrameTrace(name)
        self._cond = threading.Condition()
        self._open: dict[int, _Conversation] = {}  # by key: those that take more requests
        self._all: list[_Conversation] = []        # every conversation holding or awaiting a slot
        self._free = list(range(stage.num_slots))
        self._to_start: deque[_Conversation] = deque()
        self._running = True
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- called from request threads -------------------------------------------------------
    def open(self, key: int, setup: Any, restart: bool = False) -> None:
        """Reserve a slot for a new conversation; its state is set up before the next tick.
        `restart`: an idle open conversation with this key starts over in its slot."""
        with self._cond:
            conv = self._open.get(key)
            if conv is not None:
                if not (restart and not conv.queue and not conv.requests):
                    raise ConversationError(f"conversation {key} is already open")
                conv.setup = setup
                self._to_start.append(conv)
                self._cond.notify()
                return
            if len(self._all) >= self.stage.num_slots and self.evict_after_s is not None:
                since = time.monotonic() - self.evict_after_s
                idle = [c for c in self._open.values() if not c.queue and not c.requests and c.last_active <= since]
                if idle:
                    self._close(min(idle, key=lambda c: c.last_active))
            if len(self._all) - sum(self._closable(c) for c in self._all) >= self.stage.num_slots:
                raise ConversationError(
                    f"all {self.stage.num_slots} conversation slots are busy; try again later")
            conv = _Conversation(key, setup)
            self._open[key] = conv
            self._all.append(conv)
            self._to_start.append(conv)
            self._cond.notify()

    def is_open(self, key: int) -> bool:
        with self._cond:
            return key in self._open

    def submit(self, key: int, items: list, on_output, on_done, close: bool = False) -> None:
        """Queue items of conversation `key`; `close` ends it: its slot is freed once they are
        answered, and the key is free for a new conversation at once."""
        request = _Request(list(items), on_output, on_done)
        with self._cond:
            conv = self._open.get(key)
            if conv is None:
                raise ConversationError(
                    f"conversation {key} is not open (its start request failed, was never sent, or it ended)")
            queued = time.time()
            conv.queue.extend((request, item, queued) for item in request.items)
            conv.last_active = time.monotonic()
            if request.items:
                conv.requests.append(request)
            if close:
                self._close(conv)
            self._cond.notify()
        if not request.items:
            on_done(None)

    def open_keys(self) -> list[int]:
        with self._cond:
            return list(self._open)

    def shutdown(self) -> None:
        with self._cond:
            self._running = False
            self._cond.notify()
        self._thread.join(timeout=10)

    # -- under the lock --------------------------------------------------------------------
    def _close(self, conv: _Conversation) -> None:
        conv.closing = True
        if self._open.get(conv.key) is conv:
            del self._open[conv.key]

    def _closable(self, conv: _Conversation) -> bool:
        return conv.closing and not conv.queue and not conv.requests

    def _tickable(self, conv: _Conversation) -> bool:
        return conv.slot is not None and (bool(conv.queue) or self.stage.prefilling(conv.slot))

    def _release(self, conv: _Conversation) -> None:
        if conv.slot is not None:
            self.stage.stop(conv.slot)
            self._free.append(conv.slot)
            conv.slot = None
        if conv in self._to_start:
            self._to_start.remove(conv)
        self._all.remove(conv)

    # -- the engine thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._running and not (self._to_start or any(
                        self._closable(c) or self._tickable(c) for c in self._all)):
                    self._cond.wait()
                if not self._running:
                    return
                for conv in [c for c in self._all if self._closable(c)]:
                    self._release(conv)
                starting = list(self._to_start)
                self._to_start.clear()
                for conv in starting:
                    if conv.slot is None:  # the lowest free slot: steps run on the first rows
                        conv.slot = min(self._free)
                        self._free.remove(conv.slot)
            for conv in starting:
                self._start(conv)
            with self._cond:
                batch: dict[int, tuple[_Conversation, _Request, Any, float]] = {}
                for conv in self._all:
                    if conv.slot is None or not conv.queue or self.stage.prefilling(conv.slot):
                        continue
                    batch[conv.slot] = (conv, *conv.queue.popleft())
                prefilling = any(self.stage.prefilling(c.slot) for c in self._all if c.slot is not None)
            if batch or prefilling:
                self._tick(batch)

    def _start(self, conv: _Conversation) -> None:
        try:
            self.stage.start(conv.slot, conv.setup)
        except Exception as exc:  # a bad persona must not take the engine down
            log.exception("starting conversation %s failed", conv.key)
            self._fail(conv, f"could not start the conversation: {exc}")

    def _tick(self, batch) -> None:
        tick_start = time.time()
        try:
            outputs = self.stage.tick({slot: item for slot, (_, _, item, _) in batch.items()})
        except Exception as exc:
            log.exception("tick failed")
            for conv, _, _, _ in batch.values():
                self._fail(conv, f"internal error while stepping: {exc}")
            return
        tick_end = time.time()
        for slot, (conv, request, _, queued) in batch.items():
            if slot not in outputs:
                self._fail(conv, "internal error: the stage produced no output for a frame")
                continue
            request.on_output(outputs[slot], conv.answered)
            if self.trace.enabled:
                self.trace.frame(conv.key, conv.answered, queued, tick_start, tick_end, len(batch), time.time())
            conv.answered += 1
            request.answered += 1
            if request.answered == len(request.items):
                with self._cond:
                    conv.requests.remove(request)
                request.on_done(None)
        self.trace.flush()

    def _fail(self, conv: _Conversation, message: str) -> None:
        """End a conversation: every request it still owes answers to gets the error."""
        with self._cond:
            owed = list(conv.requests)
            conv.queue.clear()
            conv.requests.clear()
            self._close(conv)
            if conv in self._all:
                self._release(conv)
        for request in owed:
            request.on_done(message)
