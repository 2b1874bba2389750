"""What both protocols share: the gateway's state a conversation needs, and how a socket ends."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

from aiohttp import web
from personaplex_stream import Persona

from .limits import CLOSE_NORMAL, ConnectionGate, GatewayError, Limits
from .triton_session import FrameTimings, TritonChannel, TritonSession
from .voices import VoiceCatalog

log = logging.getLogger("personaplex_gateway")
CLOSE_REASON_BYTES = 123  # a WebSocket close frame's reason is at most 123 bytes
REFUSE_SEND_S = 2.0    # how long the error may wait for a client to read it
REFUSE_CLOSE_S = 12.0  # and the close: aiohttp waits 10 s for the client's reply, but not for its send


@dataclass
class GatewayContext:
    channel: TritonChannel
    limits: Limits
    voices: VoiceCatalog
    gate: ConnectionGate
    timings: FrameTimings

    def session(self, persona: Persona) -> TritonSession:
        return TritonSession(self.channel, persona, self.limits, self.timings)


def close_reason(message: str) -> bytes:
    """`message` cut to fit a close frame, whole UTF-8 characters only."""
    return message.encode("utf-8")[:CLOSE_REASON_BYTES].decode("utf-8", errors="ignore").encode("utf-8")


async def refuse(ws: web.WebSocketResponse, error: GatewayError,
                 send_error: Callable[[GatewayError], Awaitable[None]]) -> None:
    """Tell the client what went wrong in its protocol's error message, then close with the
    error's close code and its message as the reason."""
    log.info("refused (%s): %s", error.code, error.message)
    if ws.closed:
        return
    code, reason = error.close_code or CLOSE_NORMAL, close_reason(error.message)
    try:
        try:
            await asyncio.wait_for(send_error(error), REFUSE_SEND_S)
        except asyncio.TimeoutError:  # a client that reads nothing: it gets the close alone
            pass
        # A close that cannot be sent in time drops the connection (aiohttp closes the transport).
        await asyncio.wait_for(ws.close(code=code, message=reason), REFUSE_CLOSE_S)
    except (ConnectionError, RuntimeError, asyncio.TimeoutError):  # the client is gone, or reads nothing
        pass


async def pump_answers(session: TritonSession, send_answer, on_error) -> None:
    """Send each of the session's answers with `send_answer` as it arrives; a failure of the
    session goes to `on_error`."""
    try:
        async for answer in session.answers():
            await send_answer(answer)
    except GatewayError as error:
        await on_error(error)
    except (ConnectionError, RuntimeError):  # the socket closed under a send: the receive loop ends it
        pass


async def stop(task: asyncio.Task | None) -> None:
    """Cancel `task` (None: nothing to stop) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
