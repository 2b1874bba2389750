"""An OpenAI-Realtime-style endpoint at `/v1/realtime`: JSON events over a WebSocket, audio
as base64 16-bit PCM, 24 kHz mono, both ways at all times (full duplex: no turns).

Client events: `session.update` (`session.instructions`, the role prompt; `session.voice`;
`session.seed`), taken before the conversation starts; `input_audio_buffer.append` (`audio`).
The conversation (one Triton sequence) starts at the first of the two, with the defaults
where no `session.update` came first. Server events: `session.created` on connect,
`session.updated` once the persona is ready, `response.output_audio.delta` (one per
1920-sample frame, in order), `response.output_audio_transcript.delta` (the text pieces that
are not empty) and `error` (`{"code", "message"}`). Other client events get an `error` with
code `unsupported_event`, and the conversation goes on; docs/gateway.md lists them.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import secrets
import time

import aiohttp
from aiohttp import web
from personaplex_stream import Persona

from .conversation import GatewayContext, pump_answers, refuse, stop
from .framing import float_to_pcm16, pcm16_to_float
from .limits import GatewayError
from .triton_session import Answer, TritonSession
from .voices import VoiceCatalog

AUDIO_FORMAT = {"type": "audio/pcm", "rate": 24000}
SESSION_FIELDS = ("instructions", "voice", "seed")


def _event_id() -> str:
    return "event_" + secrets.token_hex(8)


def event(kind: str, **fields) -> str:
    return json.dumps({"type": kind, "event_id": _event_id(), **fields})


def error_event(error: GatewayError) -> str:
    return event("error", error={"type": "invalid_request_error" if error.close_code is None else "server_error",
                                 "code": error.code, "message": error.message})


def parse_event(text: str) -> dict:
    """A client event; GatewayError (not closing the socket) where it is not one."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GatewayError("invalid_event", f"a client event is a JSON object: {exc}", None) from None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("type"), str):
        raise GatewayError("invalid_event", 'a client event is a JSON object with a string "type"', None)
    return parsed


def persona_from_session(session: dict, voices: VoiceCatalog) -> Persona:
    """The persona of a `session.update`'s session object; unknown fields are ignored."""
    if not isinstance(session, dict):
        raise GatewayError("invalid_event", "session.update's session is a JSON object", None)
    instructions, voice, seed = (session.get(name) for name in SESSION_FIELDS)
    output = session.get("audio", {}).get("output", {}) if isinstance(session.get("audio"), dict) else {}
    if voice is None and isinstance(output, dict):
        voice = output.get("voice")  # where OpenAI's current sessions put it
    if instructions is not None and not isinstance(instructions, str):
        raise GatewayError("invalid_value", "session.instructions is a string", None)
    if voice is not None and not isinstance(voice, str):
        raise GatewayError("invalid_value", "session.voice is a string such as NATF0", None)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise GatewayError("invalid_value", f"session.seed is an integer in [0, 2**63), got {seed!r}", None)
    try:
        voice = voices.resolve(voice)
    except GatewayError as error:
        raise GatewayError(error.code, error.message, None) from None
    return Persona(voice=voice, text_prompt=instructions or None, seed=seed)


def audio_of(append: dict):
    """The float32 samples of an `input_audio_buffer.append`."""
    audio = append.get("audio")
    if not isinstance(audio, str):
        raise GatewayError("invalid_audio", "input_audio_buffer.append's audio is a base64 string", None)
    try:
        return pcm16_to_float(base64.b64decode(audio, validate=True))
    except (binascii.Error, ValueError) as exc:
        raise GatewayError("invalid_audio", f"audio is base64 16-bit PCM: {exc}", None) from None


def session_object(session_id: str, persona: Persona | None, voices: VoiceCatalog) -> dict:
    persona = persona or Persona()
    return {"id": session_id, "object": "realtime.session", "type": "realtime",
            "instructions": persona.text_prompt or "", "voice": persona.voice or voices.default_voice,
            "seed": persona.seed, "audio": {"input": {"format": AUDIO_FORMAT}, "output": {"format": AUDIO_FORMAT}}}


async def serve_realtime(ws: web.WebSocketResponse, ctx: GatewayContext) -> None:
    """One /v1/realtime conversation on a prepared WebSocket, until either side ends it."""
    session_id = "sess_" + secrets.token_hex(8)
    response_id = "resp_" + secrets.token_hex(8)
    session: TritonSession | None = None
    pump: asyncio.Task | None = None

    async def send_error(error: GatewayError) -> None:
        await ws.send_str(error_event(error))

    async def send_answer(answer: Answer) -> None:
        audio = base64.b64encode(float_to_pcm16(answer.pcm)).decode("ascii")
        await ws.send_str(event("response.output_audio.delta", response_id=response_id, delta=audio))
        if answer.text:
            await ws.send_str(event("response.output_audio_transcript.delta", response_id=response_id,
                                    delta=answer.text))
        ctx.timings.outbound_ms.append((time.perf_counter() - answer.received_at) * 1e3)
        ctx.timings.frames_out += 1

    async def begin(persona: Persona) -> TritonSession:
        nonlocal pump
        started = ctx.session(persona)
        try:
            await started.start()
        except GatewayError:
            await started.close()
            raise
        await ws.send_str(event("session.updated", session=session_object(session_id, persona, ctx.voices)))
        pump = asyncio.ensure_future(pump_answers(started, send_answer, lambda e: refuse(ws, e, send_error)))
        return started

    try:
        await ws.send_str(event("session.created", session=session_object(session_id, None, ctx.voices)))
        async for message in ws:
            received_at = time.perf_counter()
            if message.type == aiohttp.WSMsgType.ERROR:
                break
            try:
                if message.type != aiohttp.WSMsgType.TEXT:
                    raise GatewayError("invalid_event", "/v1/realtime takes JSON text messages only", None)
                ctx.limits.check_message(len(message.data))
                client_event = parse_event(message.data)
                kind = client_event["type"]
                if kind == "session.update":
                    if session is not None:
                        raise GatewayError("session_already_started", "the voice, instructions and seed are set "
                                           "before the conversation starts (its first audio)", None)
                    session = await begin(persona_from_session(client_event.get("session"), ctx.voices))
                elif kind == "input_audio_buffer.append":
                    samples = audio_of(client_event)
                    if session is None:
                        session = await begin(persona_from_session({}, ctx.voices))
                    session.feed(samples, received_at)
                else:
                    raise GatewayError("unsupported_event", f"{kind} is not supported by this server "
                                       "(docs/gateway.md lists what is)", None)
            except GatewayError as error:
                if error.close_code is not None:
                    raise
                await send_error(error)
    except GatewayError as error:
        await refuse(ws, error, send_error)
    finally:
        await stop(pump)
        if session is not None:
            await session.close()
