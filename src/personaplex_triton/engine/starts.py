"""A stage's start in pieces, so that the live conversations' ticks run between them.

A talker's start of a new persona plays its prefill: at 64 conversations on the H200 a served
start held every tick for 100-200 ms, and each made 100-150 frames late (docs/gpu-serving-log.md).
A stage that can start in pieces (`begin_starts`, as vLLM's chunked prefill) returns a
`StartJob`; the engine's loop runs one piece a pass, between ticks (engine_loop.py). A stage
that cannot (`start_many` only) starts in one piece.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

Failed = dict[int, Exception]  # slot -> why it could not start


class StartJob:
    def __init__(self, pieces: Callable[[Failed], Iterator[None]]):
        """`pieces(failed)`: a generator that does the start's work, yielding between pieces,
        and puts each slot that cannot start in `failed`."""
        self.failed: Failed = {}
        self._pieces = pieces(self.failed)

    @classmethod
    def at_once(cls, start_many: Callable[[dict[int, Any]], Failed], setups: dict[int, Any]) -> "StartJob":
        """`start_many(setups)` as a start of one piece."""
        def pieces(failed: Failed) -> Iterator[None]:
            failed.update(start_many(setups))
            yield from ()
        return cls(pieces)

    def advance(self) -> bool:
        """Run the next piece; whether the start is done."""
        try:
            next(self._pieces)
        except StopIteration:
            return True
        return False
