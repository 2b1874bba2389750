"""A conversation's progress while it streams: frames answered, the last frame's latency and
the agent's text so far, as `stream_conversation(..., on_frame=LiveLine())` reports them."""

from __future__ import annotations

import shutil
import sys
import time
from typing import Optional, TextIO

from .answers import AnsweredFrame

PLAIN_TEXT_CHARS = 60  # of the text so far on a plain line: its end


class LiveLine:
    """On a terminal, one line rewritten in place (carriage return) at most 10 times a second,
    cut to the terminal's width; elsewhere (a pipe, a log file) a plain line every `every_s`
    seconds and one for the last frame, so that a log holds a readable history."""

    def __init__(self, stream: Optional[TextIO] = None, every_s: float = 2.0):
        self.stream = stream if stream is not None else sys.stderr
        self.in_place = self.stream.isatty()
        self.every_s = 0.1 if self.in_place else every_s
        self.text = ""
        self._last_shown = float("-inf")
        self._open_line = False

    def __call__(self, frame: AnsweredFrame) -> None:
        self.text += frame.text
        now = time.monotonic()
        last = frame.index + 1 == frame.total
        if not last and now - self._last_shown < self.every_s:
            return
        self._last_shown = now
        head = f"frame {frame.index + 1}/{frame.total}  latency {frame.latency_ms:.0f} ms  text: "
        if self.in_place:
            room = max(shutil.get_terminal_size().columns - 1 - len(head), 0)
            self.stream.write("\r" + head + _tail(self.text, room).ljust(room))
            self._open_line = True
        else:
            self.stream.write(head + _tail(self.text, PLAIN_TEXT_CHARS) + "\n")
        self.stream.flush()

    def end(self) -> None:
        """Ends the line rewritten in place, if any (call once the stream is over)."""
        if self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False


def _tail(text: str, chars: int) -> str:
    """The end of `text` in at most `chars` characters, its whitespace collapsed."""
    text = " ".join(text.split())
    if len(text) <= chars:
        return text
    return "..." + text[len(text) - chars + 3:] if chars > 3 else ""
