"""Both stages as one stage of the slot engine: a tick steps the talker, then decodes the frames
it answered.

Chained as two engines (two stubs, model_repository), a frame's codes leave the talker's tick, are handed
to code2wav's engine, wait for its next tick and, on a GPU, cross into a second process and CUDA
context, which time-slices the card with the talker's: latency a frame pays for nothing. Here
the decode follows the step in the same call, process and CUDA context; the tick's answer is
the frame's audio and text.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..core.errors import StepNotRepeatable
from ..engine.prefills import PrefillJob
from ..engine.stage import Stage
from .code2wav import Code2Wav, CodesFrame
from .talker import AgentStep, Talker, TalkerSetup


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OneTickFrame:
    """One slot's answer: the talker's step (codes, text token) and its audio, 1920 samples."""

    step: AgentStep
    pcm: np.ndarray


class OneTickStage(Stage):
    def __init__(self, talker: Talker, code2wav: Code2Wav):
        self.talker = talker
        self.code2wav = code2wav
        self.num_slots = min(talker.num_slots, code2wav.num_slots)
        # When the last tick's talker step ended and its decode began (wall clock), for the
        # frame trace: the tick's two parts are the two stages' ticks (core/trace.py).
        self.last_tick_split: float | None = None

    def prefill_many(self, setups: dict[int, TalkerSetup]) -> dict[int, Exception]:
        failed = self.talker.prefill_many(setups)
        self.code2wav.prefill_many({slot: None for slot in setups if slot not in failed})
        return failed

    def begin_prefills(self, setups: dict[int, TalkerSetup]) -> PrefillJob:
        """The talker's prefill in chunks; the decoder's streams are reset at once (one reset,
        no model pass), as a slot that fails its prefill is never ticked."""
        self.code2wav.prefill_many({slot: None for slot in setups})
        return self.talker.begin_prefills(setups)

    def stop(self, slot: int) -> None:
        self.talker.stop(slot)
        self.code2wav.stop(slot)

    def tick(self, user_frames: dict[int, np.ndarray]) -> dict[int, OneTickFrame]:
        steps = self.talker.tick(user_frames)
        self.last_tick_split = time.time()
        pcm = self._decode({slot: CodesFrame(step.codes) for slot, step in steps.items()})
        return {slot: OneTickFrame(step, pcm[slot]) for slot, step in steps.items()}

    def _decode(self, frames: dict[int, CodesFrame]) -> dict[int, np.ndarray]:
        """The decode, tried twice as code2wav's own engine would; the engine must not retry the
        whole tick, whose talker step is done (StepNotRepeatable)."""
        for attempt in (1, 2):
            try:
                return self.code2wav.tick(frames)
            except torch.OutOfMemoryError as exc:
                torch.cuda.empty_cache()  # what this process caches, for the second try
                error, out_of_memory = exc, True
            except Exception as exc:
                error, out_of_memory = exc, False
            log.warning("decoding a tick's frames failed (try %d of 2): %s", attempt, error)
        raise StepNotRepeatable(f"decoding the tick's audio failed: {type(error).__name__}: {error}",
                                out_of_memory) from error

    def close(self) -> None:
        self.talker.close()
