"""The engine's output processing: a tick's answers leave for their requests.

`AnswerSender.deliver` runs on the engine's outbox thread (outbox.py), a tick's answers at a
time. Each answer goes to its request in order, the request's last one completing it; a send
that fails ends that conversation only (the engine's `fail`). Every answer sent is counted in
the metrics and, when tracing, timed into the frame trace. `finish` completes a request
otherwise (an error, or an empty closing request at its conversation's release).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from ..core import metrics as reasons
from ..core.fault_injection import FaultPlan
from ..core.metrics import Metrics
from ..core.trace import FrameTrace
from .conversations import Conversation, Request

log = logging.getLogger(__name__)


def finish(name: str, on_done: Callable[[str | None], None], error: str | None) -> None:
    """Complete a request; a failure to is logged, never raised into the engine's threads."""
    try:
        on_done(error)
    except Exception:
        log.exception("%s: answering a request failed", name)


class TickSpan(NamedTuple):
    """A tick as the frame trace records it: its wall-clock start and end, the CPU time of the
    thread that ran it (a tick's GPU waits spin on the CPU, so a tick far longer than its CPU time
    waited off it: for the GIL, held by the stub's other threads, or a lock) and, for a stage
    that steps both stages in one tick (stages/one_tick.py), when its second part began."""

    start: float
    end: float
    cpu: float
    split: float | None = None


@dataclass
class Answer:
    """A stage's output for one item, waiting in the outbox."""
    conversation: Conversation
    request: Request
    output: Any
    index: int          # the item's index in its conversation
    queued: float       # for the frame trace: when the item was queued, the tick that took it
    tick_span: TickSpan
    rows: int


class AnswerSender:
    def __init__(self, name: str, lock: threading.Condition, fail: Callable[[Conversation, str, str], None],
                 metrics: Metrics, trace: FrameTrace, faults: FaultPlan | None = None,
                 on_answered: Callable[[float], None] = lambda latency_s: None):
        """`lock`: the engine's, over its conversations (notified when a request completes, as a
        closing conversation may then free its slot); `fail(conversation, message, reason)`
        ends a conversation; `on_answered(latency_s)`: a frame was answered that long after it
        could be (the scheduler's admission reads them)."""
        self.name = name
        self._lock = lock
        self._fail = fail
        self.metrics = metrics
        self.trace = trace
        self.faults = faults
        self._on_answered = on_answered

    def deliver(self, answers: list[Answer]) -> None:
        for answer in answers:
            self._send(answer)
        self.trace.flush()

    def _send(self, answer: Answer) -> None:
        conv, request = answer.conversation, answer.request
        with self._lock:
            if request not in conv.requests:  # the conversation ended since its tick
                return
        last = request.answered + 1 == len(request.items)
        try:
            if self.faults is not None:
                self.faults.before_send(conv.key)
            if not request.send(answer.output, answer.index, last):
                return
        except Exception as exc:  # the client is gone, or the response could not be made
            log.warning("%s: sending a frame of conversation %s failed: %s", self.name, conv.key, exc)
            self._fail(conv, f"could not send a response: {exc}", reasons.INTERNAL)
            return
        now = time.monotonic()
        self.metrics.frame_answered(now - request.received)
        # From when the frame could be answered: its arrival; or its conversation's last answer
        # where frames came faster than real time (an offline client's window), which waited
        # for their own conversation's earlier frames, not for the server; or the end of its
        # conversation's prefill, which the live conversations did not wait for.
        self._on_answered(now - max(request.received, conv.answerable_from))
        conv.answerable_from = now
        if self.trace.enabled:
            span = answer.tick_span
            self.trace.frame(conv.key, answer.index, answer.queued, span.start, span.end, span.cpu, answer.rows,
                             time.time(), split=span.split)
        request.answered += 1
        if last:
            with self._lock:
                conv.requests.remove(request)
                conv.last_active = time.monotonic()  # idle from its last answer on
                self._lock.notify()
