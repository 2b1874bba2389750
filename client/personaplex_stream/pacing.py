"""Pacing a conversation's sends: as a live microphone would, or as fast as the server answers.
Either way the answers that come in while a frame waits its turn are taken meanwhile."""

from __future__ import annotations

import time

from . import contract
from .answers import AnswerCollector

FRAME_SECONDS = contract.FRAME_SAMPLES / contract.SAMPLE_RATE  # 0.08
STALL_CHECK_S = 0.05  # while a paced frame waits, the stall timeout is checked this often at least


class RealtimePacing:
    """One frame every 80 ms on an absolute schedule that starts when the pacing is made, however
    fast the server answers: a late answer does not delay the next frame, as with a speaker."""

    def __init__(self, answers: AnswerCollector):
        self.answers = answers
        self.start = time.perf_counter()

    def wait_for_turn(self, i: int) -> None:
        """Until frame i's time (`start + i * 80 ms`), taking answers; StreamTimeoutError on a stall."""
        target = self.start + i * FRAME_SECONDS
        while True:
            now = time.perf_counter()
            self.answers.check_stall(now)
            if now >= target:
                return
            self.answers.wait_one(min(target, now + STALL_CHECK_S))


class WindowPacing:
    """As fast as the server answers, with at most `max_in_flight` frames unanswered."""

    def __init__(self, answers: AnswerCollector, max_in_flight: int):
        self.answers = answers
        self.max_in_flight = max_in_flight

    def wait_for_turn(self, i: int) -> None:
        """Until frame i leaves fewer than `max_in_flight` unanswered before it."""
        self.answers.wait_until_answered(i - self.max_in_flight + 1)
