"""Stage 1: streaming Mimi decoding for a pool of conversations, batched per tick."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engine.stage import Stage
from ..mimi.runtime import StepRunner
from ..mimi.stream import MimiSlots


@dataclass(frozen=True)
class CodesFrame:
    """One frame to decode: the agent's codes [8], and the talker tick that answered it
    ((id, frames it answered); None: unknown), which the engine's scheduler gathers by."""

    codes: np.ndarray
    tick: tuple[int, int] | None = None


def tick_group(frame: CodesFrame) -> tuple[int, int] | None:
    """The scheduler's `gather` for code2wav: a frame's talker tick."""
    return frame.tick


class Code2Wav(Stage):
    """A `Stage` of the slot engine: agent codes [8] in, 1920 PCM samples out, per slot."""

    def __init__(self, decoder: StepRunner, num_slots: int):
        self.num_slots = num_slots
        self.mimi = MimiSlots(decoder, num_slots)

    def prefill(self, slot: int, setup=None) -> None:
        self.prefill_many({slot: setup})

    def prefill_many(self, setups: dict) -> dict[int, Exception]:
        """Fresh decoder streams for these slots, in one reset; none can fail."""
        self.mimi.reset(list(setups))
        return {}

    def stop(self, slot: int) -> None:
        pass  # the next prefill resets the row

    def take_largest_tick(self) -> None:
        """Decode one frame in every slot, then reset them all: the memory of the largest tick
        is taken now (a GPU's caching allocator keeps it), not in a tick under load, when the
        talker's process beside this one may have taken the rest."""
        self.mimi.decode({slot: np.zeros(self.mimi.input.shape, dtype=np.int64) for slot in range(self.num_slots)})
        self.mimi.reset(range(self.num_slots))

    def tick(self, items: dict[int, CodesFrame]) -> dict[int, np.ndarray]:
        return self.mimi.decode({slot: frame.codes for slot, frame in items.items()})
