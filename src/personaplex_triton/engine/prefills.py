"""A stage's prefill in chunks, so that the live conversations' ticks run between them.

A talker's prefill of a new persona plays the persona into the slot: run whole, it would hold
every live conversation's tick for its length and make their frames late. A stage that can
prefill in chunks (`begin_prefills`, as vLLM's chunked prefill) returns a `PrefillJob` whose
chunks the engine's loop runs one a pass, between ticks (engine_loop.py); a stage that cannot
(`prefill_many` only) prefills in one chunk (stage.Stage's default).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

Failed = dict[int, Exception]  # slot -> why it could not be prefilled


class PrefillJob:
    def __init__(self, chunks: Callable[[Failed], Iterator[None]]):
        """`chunks(failed)`: a generator that does the prefill's work, yielding between chunks,
        and puts each slot that cannot be prefilled in `failed`."""
        self.failed: Failed = {}
        self._chunks = chunks(self.failed)

    @classmethod
    def at_once(cls, prefill_many: Callable[[dict[int, Any]], Failed], setups: dict[int, Any]) -> "PrefillJob":
        """`prefill_many(setups)` as a prefill of one chunk."""
        def chunks(failed: Failed) -> Iterator[None]:
            failed.update(prefill_many(setups))
            yield from ()
        return cls(chunks)

    def advance(self) -> bool:
        """Run the next chunk; whether the prefill is done."""
        try:
            next(self._chunks)
        except StopIteration:
            return True
        return False
