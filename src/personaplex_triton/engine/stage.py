"""What the engine drives: a stage owns per-slot model state and answers `tick(items)` with one
batched step. Stages subclass `Stage`; its hooks have defaults, so the engine calls them on
every stage alike."""

from __future__ import annotations

from typing import Any

from .prefills import Failed, PrefillJob


class Stage:
    num_slots: int
    # The CPU time the last tick took where the stage ran it, for the tick's trace; None: the
    # engine's own thread ran it (a stage in a process of its own reports its process's).
    last_tick_cpu_s: float | None = None
    # When the last tick's second part began (wall clock), for the trace (core/trace.py); None:
    # the tick has one part.
    last_tick_split: float | None = None

    def prefill_many(self, setups: dict[int, Any]) -> Failed:
        """Prefill these slots for new conversations, together (setting each up in full);
        returns those that could not be prefilled, with why."""
        raise NotImplementedError

    def begin_prefills(self, setups: dict[int, Any]) -> PrefillJob:
        """The same prefill in chunks, which the engine runs one a pass, between ticks
        (prefills.py); by default one chunk."""
        return PrefillJob.at_once(self.prefill_many, setups)

    def stop(self, slot: int) -> None:
        """The slot's conversation ended; the next prefill sets the slot up afresh."""
        raise NotImplementedError

    def tick(self, items: dict[int, Any]) -> dict[int, Any]:
        """One batched step of the slots in `items`: slot -> its answer."""
        raise NotImplementedError

    def raise_if_dead(self) -> None:
        """Raise if the stage can never tick again (asked at each heartbeat, between ticks)."""

    def close(self) -> None:
        """Free what the stage holds (its threads, graphs); the engine has stopped."""
