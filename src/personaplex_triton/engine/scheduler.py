"""What each tick carries and when it starts: the engine's scheduler, apart from the stage's
step (ticker.py) and from the answers (outbox.py, answers.py), as in vLLM's engine.

`schedule()` returns a `TickPlan`: each waiting conversation's next frame, packed (the stage
runs exactly those rows: a compact tick, lm/slot_states.py), the frame that has waited longest
first. The plan's order is the order in which the tick's answers leave, one send after another
(a Python-backend stub sends one response at a time): oldest first, the frame nearest its
deadline does not queue behind the others' sends (in join order, the last conversation to join
always went last, and its frames were late more often; docs/decisions.md). A tick starts
as soon as a frame waits: such ticks regulate themselves (a longer tick lets more frames gather
for the next, so batches grow with load), and waiting for deadlines adds latency and gains
nothing. A stage whose frames arrive one response at a time from another stage's tick
(code2wav: a talker tick's answers leave one by one) gathers them: `gather(item)` names the
item's group and its size (the talker tick that answered it, and how many frames that tick
answered), and a tick waits until the oldest waiting item's group has all arrived, at most
`gather_max_s` (a frame of the group may never come: its conversation ended). One talker tick
then makes one decoder tick, not a few fragments that each take the GPU from the talker.

A chunked prefill (prefills.py) runs between the ticks, one chunk a pass of the engine's loop.
`chunk_spacing_ticks` > 1 keeps that many ticks between two chunks of a prefill while live
frames wait: a frame that comes during the tick just before a chunk waits for the rest of that
tick, the chunk, and the tick after it, which carries what piled up meanwhile. With one tick
between two chunks that tick is itself a large catch-up tick, which makes more of the live
frames late; with two it is a normal one, at the cost of a longer prefill. A prefill's first
chunk (the whole of a cached persona's prefill, or code2wav's reset) runs at once.

`record()` takes each tick's frames and duration (the ticker's, which the metrics count too:
frames per tick, ticks per second and the busy fraction are theirs) into a linear tick-cost
model (`TickModel`), from which `admission_error` refuses a newcomer that would make the live
conversations late. It refuses one too while the answers wait to be sent for longer than
SENDS_BEHIND_LIMIT_S (the outbox's `behind_s`): then the sends, not the ticks, make every frame
late, and one more conversation only adds to them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from .conversations import ConversationTable

FRAME_S = 0.08          # a frame of audio: one conversation's frames arrive this often
MODEL_TICKS = 256       # ticks the cost model is fitted on
MODEL_MIN_TICKS = 32    # fewer: no admission by time yet (nothing measured)
MEMORY_FULL_S = 30.0    # after a tick ran out of GPU memory, newcomers are refused this long
# Answers waiting this long to be sent: the sends cannot keep up, newcomers are refused. Three
# frames' worth: well above what the oldest answer waits while the sends keep up, well below the
# seconds it waits once they cannot (docs/decisions.md).
SENDS_BEHIND_LIMIT_S = 0.25
# The live conversations' answers over the last LATENCY_WINDOW_S, from which a newcomer is
# refused while they come late (`admission_latency_s`); fewer than LATENCY_MIN_FRAMES: no verdict.
LATENCY_WINDOW_S = 2.0
LATENCY_MIN_FRAMES = 50


@dataclass(frozen=True)
class TickPlan:
    """What one tick carries: slot -> (conversation, request, item, queued at), in row order."""

    items: dict

    def __len__(self) -> int:
        return len(self.items)


class TickModel:
    """A tick's cost as measured: seconds = fixed + per_frame * frames, least squares over the
    last MODEL_TICKS ticks (the fixed part is the weight read, the per-frame part the rows'
    attention and sampling, which grow with their contexts)."""

    def __init__(self):
        self._ticks: deque[tuple[int, float]] = deque(maxlen=MODEL_TICKS)

    def add(self, frames: int, seconds: float) -> None:
        self._ticks.append((frames, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_frame) seconds, or None until enough ticks of different sizes."""
        n = len(self._ticks)
        if n < MODEL_MIN_TICKS:
            return None
        mean_k = sum(k for k, _ in self._ticks) / n
        mean_t = sum(t for _, t in self._ticks) / n
        spread = sum((k - mean_k) ** 2 for k, _ in self._ticks)
        if spread == 0:  # one tick size only: nothing known of the per-frame part yet
            return mean_t, 0.0
        per_frame = max(sum((k - mean_k) * (t - mean_t) for k, t in self._ticks) / spread, 0.0)
        return max(mean_t - per_frame * mean_k, 0.0), per_frame

    def steady_tick_s(self, conversations: int) -> float | None:
        """The tick length at which `conversations` paced conversations settle, ticking back to
        back (each tick carries the frames that came during the last: k = n * T / FRAME_S, so
        T = fixed / (1 - n * per_frame / FRAME_S)); inf where they cannot keep up, None while
        nothing is measured."""
        fitted = self.fit()
        if fitted is None:
            return None
        fixed, per_frame = fitted
        load = conversations * per_frame / FRAME_S
        if load >= 1:
            return float("inf")
        return fixed / (1 - load)


class RecentLatencies:
    """The latencies (from when a frame could be answered to its answer's send: answers.py) of
    the frames answered over the last LATENCY_WINDOW_S: what the host, not only the GPU, made of
    the live conversations.
    Answers are noted from the outbox's threads, read from the request threads."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._answered: deque[tuple[float, float]] = deque()

    def note(self, latency_s: float) -> None:
        with self._lock:
            now = self._clock()
            self._answered.append((now, latency_s))
            self._forget_before(now - LATENCY_WINDOW_S)

    def __len__(self) -> int:
        """The answers kept (those of the window, once the next answer or read has pruned it)."""
        return len(self._answered)

    def _forget_before(self, since: float) -> None:
        while self._answered and self._answered[0][0] < since:
            self._answered.popleft()

    def p99(self) -> float | None:
        """The 99th percentile over the window; None with fewer than LATENCY_MIN_FRAMES."""
        with self._lock:
            self._forget_before(self._clock() - LATENCY_WINDOW_S)
            latencies = sorted(latency for _, latency in self._answered)
        if len(latencies) < LATENCY_MIN_FRAMES:
            return None
        return latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]


class Scheduler:
    def __init__(self, table: ConversationTable, gather: Callable[[Any], tuple[int, int] | None] | None = None,
                 gather_max_s: float = 0.0, admission_tick_s: float = 0.0, chunk_spacing_ticks: int = 1,
                 admission_latency_s: float = 0.0, clock=time.time, latency_clock=time.monotonic):
        """`gather`, `gather_max_s`: how a tick gathers frames (the module docstring; None: it
        starts as soon as one waits). `admission_tick_s`: a new conversation is refused
        when the tick model says the live ones and it would settle at ticks longer than this
        (a frame waits up to one tick and is answered at the end of the next: about two
        ticks); 0: no admission by time. `chunk_spacing_ticks`: the ticks
        between two chunks of a prefill while live frames wait (the module docstring; 1: as the
        loop runs, a chunk a pass). `admission_latency_s`: a new conversation is refused while the
        live ones' answers over the last LATENCY_WINDOW_S have a p99 over this (what the tick model
        does not see: a slow or noisy host's sends and request threads); 0: not. `clock`: the
        wall clock, which the queue's items are stamped with (for the frame trace);
        `latency_clock`: the answers' (`answered`)."""
        if chunk_spacing_ticks < 1:
            raise ValueError(f"the ticks between a prefill's chunks must be at least 1, got {chunk_spacing_ticks}")
        self._table = table
        self.gather = gather
        self.gather_max_s = gather_max_s
        self.admission_tick_s = admission_tick_s
        self.admission_latency_s = admission_latency_s
        self.latencies = RecentLatencies(latency_clock)
        self.chunk_spacing_ticks = chunk_spacing_ticks
        self._ticks_since_chunk = chunk_spacing_ticks
        self._clock = clock
        self.model = TickModel()
        self._memory_full_at: float | None = None

    # -- what a tick carries, and when ------------------------------------------------------
    def due_in(self) -> float | None:
        """Seconds until the next tick is due: 0 now, None while no frame waits."""
        now = self._clock()
        ready = self._table.ready()
        queues = [conv.queue for conv in ready if conv.queue]
        if not queues:
            return None
        if self.gather is None:
            return 0.0
        _, item, queued = min((queue[0] for queue in queues), key=lambda entry: entry[2])
        group = self.gather(item)
        if group is None:
            return 0.0
        key, size = group
        arrived = sum(1 for queue in queues for _, other, _ in queue if (self.gather(other) or (None,))[0] == key)
        return 0.0 if arrived >= size else max(0.0, queued + self.gather_max_s - now)

    def schedule(self) -> TickPlan | None:
        """The next tick, if one is due: every waiting conversation's next frame, oldest first."""
        due = self.due_in()
        if due is None or due > 0:
            return None
        self._ticks_since_chunk += 1
        rows = [(c.slot, (c, *c.queue.popleft())) for c in self._table.ready() if c.queue]
        return TickPlan(dict(sorted(rows, key=lambda row: row[1][3])))  # by the time each was queued

    def chunk_due(self, first: bool) -> bool:
        """Whether a prefill's next chunk may run now (`first`: its first chunk): always with
        `chunk_spacing_ticks` 1 and for a first chunk; else once that many ticks have run since
        the last chunk, or when no live frame waits (a chunk then holds no one up)."""
        return (first or self.chunk_spacing_ticks <= 1 or self._ticks_since_chunk >= self.chunk_spacing_ticks
                or self.due_in() is None)

    def chunk_ran(self) -> None:
        self._ticks_since_chunk = 0

    # -- what ticks cost ----------------------------------------------------------------------
    def record(self, frames: int, seconds: float) -> None:
        """A tick stepped `frames` frames in `seconds`."""
        self.model.add(frames, seconds)

    def answered(self, latency_s: float) -> None:
        """A frame was answered `latency_s` after it could be (from any thread)."""
        if self.admission_latency_s > 0:
            self.latencies.note(latency_s)

    def out_of_memory(self) -> None:
        """A tick ran out of GPU memory: newcomers are refused for MEMORY_FULL_S."""
        self._memory_full_at = self._clock()

    def admission_error(self, live: int, sends_behind_s: float = 0.0) -> str | None:
        """Why one more conversation beside `live` would make them late (or could not be held),
        or None. `sends_behind_s`: how long the oldest answer not yet sent has waited."""
        if self._memory_full_at is not None and self._clock() - self._memory_full_at < MEMORY_FULL_S:
            return (f"at capacity: a tick ran out of GPU memory {self._clock() - self._memory_full_at:.0f} s ago "
                    f"with {live} live conversations")
        if sends_behind_s > SENDS_BEHIND_LIMIT_S:
            return (f"at capacity: the answers leave {sends_behind_s:.2f} s after their ticks (the limit is "
                    f"{SENDS_BEHIND_LIMIT_S:.2f} s): the server cannot send them in real time; try again later")
        if self.admission_latency_s > 0 and live:
            p99 = self.latencies.p99()
            if p99 is not None and p99 > self.admission_latency_s:
                return (f"at capacity: the {live} live conversations' frames are answered in up to {p99 * 1e3:.0f} ms "
                        f"(p99 of the last {LATENCY_WINDOW_S:.0f} s; the limit is {self.admission_latency_s * 1e3:.0f} "
                        "ms): this host cannot take one more in real time; try again later")
        if self.admission_tick_s <= 0:
            return None
        tick = self.model.steady_tick_s(live + 1)
        # A frame waits up to one tick and is answered at the end of its own: held to two of
        # admission_tick_s's ticks.
        if tick is None or tick <= self.admission_tick_s:
            return None
        settles = "cannot keep up" if tick == float("inf") else f"would settle at {tick * 1e3:.0f} ms ticks"
        return (f"at capacity: {live} live conversations and one more {settles} "
                f"(the limit is {self.admission_tick_s * 1e3:.0f} ms, to answer every frame in real time)")
