"""What the gateway lets a client do: how many conversations at once, how big a message,
how fast the audio, how much of the agent's audio may wait unread; and the error every refusal
carries outward."""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass

from aiohttp import web

from .framing import FRAME_SECONDS

# WebSocket close codes (RFC 6455, and IANA's registry for 1013).
CLOSE_NORMAL = 1000
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_SERVER_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013

SEND_BUFFER_BYTES = 64 * 1024  # a conversation socket's kernel send buffer (Linux doubles it): 1 s of the
                               # Realtime API's audio, 10 of Opus; far more than one RTT of either


class GatewayError(Exception):
    """A refusal with a machine-readable `code`, a message for people, and the WebSocket close
    code it ends the socket with (None: the socket stays open)."""

    def __init__(self, code: str, message: str, close_code: int | None = CLOSE_POLICY):
        super().__init__(message)
        self.code = code
        self.message = message
        self.close_code = close_code


@dataclass(frozen=True)
class Limits:
    """max_connections: conversations at once; max_message_bytes: the largest WebSocket message
    accepted; audio_burst_s: audio a client may send ahead of real time that still goes to
    Triton at once; audio_max_ahead_s: audio held back beyond that (throttled) before the
    client is refused; unsent_max_s: the agent's audio the gateway holds unsent, the client not
    reading its socket, before the conversation ends."""

    max_connections: int = 64
    max_message_bytes: int = 128 * 1024
    audio_burst_s: float = 1.0
    audio_max_ahead_s: float = 3.0
    unsent_max_s: float = 10.0

    def __post_init__(self):
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be at least 1024, got {self.max_message_bytes}")
        if self.audio_burst_s < 0 or self.audio_max_ahead_s <= 0:
            raise ValueError("audio_burst_s must be >= 0 and audio_max_ahead_s > 0, got "
                             f"{self.audio_burst_s} and {self.audio_max_ahead_s}")
        if self.unsent_max_s <= 0:
            raise ValueError(f"unsent_max_s must be > 0, got {self.unsent_max_s}")

    @property
    def transport_max_bytes(self) -> int:
        """The transport's own bound: messages up to it are read and refused with an error that
        names the cap; past it the WebSocket library closes the socket (1009) unread."""
        return 4 * self.max_message_bytes

    def check_message(self, size: int) -> None:
        if size > self.max_message_bytes:
            raise GatewayError("message_too_large", f"a message of {size} bytes is over the gateway's "
                               f"limit of {self.max_message_bytes} bytes", CLOSE_TOO_BIG)


def bound_send_buffer(request: web.Request) -> None:
    """Fix the kernel's send buffer of a conversation's socket at SEND_BUFFER_BYTES: autotuned, it
    grows to 4 MB (a minute of the Realtime API's audio, more of Opus) for a client that reads
    nothing, before the gateway's own bound on unsent answers (`Limits.unsent_max_s`) sees it."""
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)


class ConnectionGate:
    """Counts the conversations open; past `capacity` a newcomer is refused (not queued)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.open = 0

    def enter(self) -> None:
        if self.open >= self.capacity:
            raise GatewayError("too_many_connections", f"the gateway is full: {self.open} conversations "
                               f"of {self.capacity} are open; try again later", CLOSE_TRY_AGAIN_LATER)
        self.open += 1

    def leave(self) -> None:
        self.open -= 1


class AudioPacer:
    """Real-time pacing of one conversation's frames into Triton.

    The clock starts at the first frame that arrives once the session is ready (or at ready,
    for frames that came before). Frame i may go at `due(i)`: the first `burst` frames at once,
    then one every 80 ms. A frame that arrives while more than `max_ahead` frames already wait
    for their turn is refused: a client faster than real time is throttled, then stopped, and
    the gateway never holds more than `burst + max_ahead` frames of it.
    """

    def __init__(self, burst_s: float, max_ahead_s: float, frame_s: float = FRAME_SECONDS):
        self.frame_s = frame_s
        self.burst = math.floor(burst_s / frame_s)
        self.max_ahead = max(1, math.floor(max_ahead_s / frame_s))
        self._ready = False
        self._t0: float | None = None

    def open(self, now: float, frames_waiting: int) -> None:
        """The session is ready: frames may go; the clock starts now if some already wait."""
        self._ready = True
        if frames_waiting:
            self._t0 = now

    def arrive(self, index: int, now: float) -> None:
        """Frame `index` (from 0) arrived; GatewayError where the client runs too far ahead."""
        if self._ready and self._t0 is None:
            self._t0 = now
        elapsed = (now - self._t0) / self.frame_s if self._t0 is not None else 0.0
        allowed = self.burst + self.max_ahead + math.floor(elapsed)
        if index >= allowed:
            ahead_s = (index - math.floor(elapsed)) * self.frame_s
            raise GatewayError("audio_too_fast", f"audio arrives faster than real time: {ahead_s:.2f} s ahead, "
                               f"over the limit of {(self.burst + self.max_ahead) * self.frame_s:.2f} s")

    def due(self, index: int) -> float:
        """When frame `index` may go to Triton (perf_counter time); the clock must be running."""
        return self._t0 + max(0, index - self.burst) * self.frame_s
