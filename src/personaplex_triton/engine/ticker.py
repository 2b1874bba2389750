"""The engine's tick: one batched step of the stage, its outputs handed to the outbox as answers.

Faults stay where they arise: a failing step ends the conversation it names (`SlotFault`) and
the rest step again; a step that failed after its state moved (`StepNotRepeatable`) ends the
conversations in it; any other failure is retried once, then ends the conversations in it.
Either way the engine's loop goes on. A tick that runs out of GPU memory is retried the same
way, and the scheduler refuses new conversations for a while (`on_out_of_memory`): a full card
turns newcomers away rather than failing the live conversations.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from ..core import metrics as reasons
from ..core.errors import SlotFault, StepNotRepeatable
from ..core.fault_injection import FaultPlan
from ..core.metrics import Metrics
from .answers import Answer, TickSpan
from .conversations import Conversation
from .outbox import Outbox
from .stage import Stage
from .stage_process import StageProcessDied

log = logging.getLogger(__name__)


class Ticker:
    def __init__(self, name: str, stage: Stage, lock: threading.Condition, fail: Callable[[Conversation, str, str], None],
                 outbox: Outbox, metrics: Metrics, faults: FaultPlan | None = None,
                 on_tick: Callable[[int, float], None] = lambda frames, seconds: None,
                 on_out_of_memory: Callable[[], None] = lambda: None):
        """`stage`: the engine's (stage.Stage); `lock`: the engine's, over its conversations;
        `fail(conversation, message, reason)` ends a conversation; `on_tick(frames, seconds)`: a
        stage's tick stepped that many frames in that time (as the metrics count it);
        `on_out_of_memory()`: a tick ran out of GPU memory."""
        self.name = name
        self.stage = stage
        self._lock = lock
        self._fail = fail
        self._outbox = outbox
        self.metrics = metrics
        self.faults = faults
        self._on_tick = on_tick
        self._on_out_of_memory = on_out_of_memory
        # The last tick, for the trace (answers.py).
        self.tick_span = TickSpan(0.0, 0.0, 0.0)

    def tick(self, batch) -> None:
        """Step `batch` (a TickPlan's items, scheduler.py) and put its answers in the outbox."""
        outputs = self._step(batch)
        if outputs is None:
            return
        answers = []
        for slot, (conv, request, _, queued) in batch.items():
            if conv.slot != slot:  # ended while stepping
                continue
            if slot not in outputs:
                self._fail(conv, "internal error: the stage produced no output for a frame", reasons.INTERNAL)
                continue
            answers.append(Answer(conv, request, outputs[slot], conv.answered, queued, self.tick_span, len(batch)))
            conv.answered += 1
        self._outbox.put(answers)

    def _ticked(self, batch) -> list[Conversation]:
        """The conversations a tick steps: those with an item, less any ended meanwhile (by a
        failed send or a lost frame, on other threads)."""
        with self._lock:
            return [conv for slot, (conv, _, _, _) in batch.items() if conv.slot == slot]

    def _step(self, batch) -> dict | None:
        """The stage's tick over `batch`; None if it failed for good (its conversations got the
        error). A fault that names a slot ends that conversation and the rest step again."""
        retried = False
        while True:
            ticked = self._ticked(batch)
            if not ticked:
                return None
            started = time.monotonic()
            try:
                if self.faults is not None:
                    self.faults.before_tick({c.key: c.slot for c in ticked})
                began, cpu = time.time(), time.thread_time()
                outputs = self.stage.tick({slot: item for slot, (_, _, item, _) in batch.items()})
                # a stage in a process of its own (stage_process.py) ticks on that process's CPU
                reported = self.stage.last_tick_cpu_s
                self.tick_span = TickSpan(began, time.time(), time.thread_time() - cpu if reported is None else reported,
                                          self.stage.last_tick_split)
            except StageProcessDied:  # nothing to retry: the engine stops (engine_loop.py)
                raise
            except StepNotRepeatable as exc:  # the stage's state moved: a retry would step it twice
                error, retried = exc, True
                if exc.out_of_memory:
                    self._on_out_of_memory()
            except SlotFault as exc:
                culprit = next((c for c in ticked if c.slot == exc.slot), None)
                if culprit is not None:
                    log.error("%s: step failed in conversation %s: %s", self.name, culprit.key, exc)
                    batch.pop(exc.slot, None)
                    self._fail(culprit, f"internal error while stepping this conversation: {exc}", reasons.INTERNAL)
                    continue
                error = exc
            except torch.OutOfMemoryError as exc:
                error = exc
                self._on_out_of_memory()
                torch.cuda.empty_cache()  # what this process caches, for the retry
            except Exception as exc:
                error = exc
            else:
                seconds = time.monotonic() - started
                self.metrics.tick(seconds, len(ticked))
                self._on_tick(len(ticked), seconds)
                return outputs
            if not retried:
                log.warning("%s: step failed (%s); retrying it once", self.name, error)
                retried = True
                continue
            log.error("%s: step failed %s; ending the %d conversations in it", self.name,
                      "and cannot be retried" if isinstance(error, StepNotRepeatable) else "twice", len(ticked),
                      exc_info=error)
            for conv in ticked:
                self._fail(conv, f"internal error while stepping: {error}", reasons.INTERNAL)
            return None
