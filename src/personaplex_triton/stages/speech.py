"""Both stages as one stage of the slot engine: a tick steps the talker, then decodes the frames
it answered.

Chained as two engines (serving/speech.py), a frame's codes leave the talker's tick, are handed
to code2wav's engine, wait for its next tick and, on a GPU, cross into a second process and CUDA
context, which time-slices the card with the talker's. At 1 conversation on an H100 that was
about 1 ms of a 15.2 ms frame (docs/gpu-serving-log.md). Here the decode follows the step in the
same call, process and CUDA context; the tick's answer is the frame's audio and text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..engine.starts import StartJob
from .code2wav import Code2Wav, CodesFrame
from .talker import AgentStep, Talker, TalkerSetup


@dataclass(frozen=True)
class SpeechFrame:
    """One slot's answer: the talker's step (codes, text token) and its audio, 1920 samples."""

    step: AgentStep
    pcm: np.ndarray


class Speech:
    def __init__(self, talker: Talker, code2wav: Code2Wav):
        self.talker = talker
        self.code2wav = code2wav
        self.num_slots = min(talker.num_slots, code2wav.num_slots)
        # When the last tick's talker step ended and its decode began (wall clock), for the
        # frame trace: the tick's two parts are the two stages' ticks (core/trace.py).
        self.last_tick_split: float | None = None

    def start_many(self, setups: dict[int, TalkerSetup]) -> dict[int, Exception]:
        failed = self.talker.start_many(setups)
        self.code2wav.start_many({slot: None for slot in setups if slot not in failed})
        return failed

    def begin_starts(self, setups: dict[int, TalkerSetup]) -> StartJob:
        """The talker's start in pieces; the decoder's streams are reset at once (one reset, no
        model pass), as a slot that fails to start is never ticked."""
        self.code2wav.start_many({slot: None for slot in setups})
        return self.talker.begin_starts(setups)

    def stop(self, slot: int) -> None:
        self.talker.stop(slot)
        self.code2wav.stop(slot)

    def tick(self, user_frames: dict[int, np.ndarray]) -> dict[int, SpeechFrame]:
        steps = self.talker.tick(user_frames)
        self.last_tick_split = time.time()
        pcm = self.code2wav.tick({slot: CodesFrame(step.codes) for slot, step in steps.items()})
        return {slot: SpeechFrame(step, pcm[slot]) for slot, step in steps.items()}

    def close(self) -> None:
        self.talker.close()
