"""PersonaPlex's browser protocol at `/api/chat`, so that its web client and moshi's clients
connect unchanged.

    GET /api/chat?text_prompt=...&voice_prompt=NATF2.pt&seed=42   (upgrades to a WebSocket)

Every message is binary with a 1-byte kind. Server to client: 0x00 the handshake, once the
persona is ready; 0x01 Ogg/Opus audio (24 kHz mono); 0x02 a UTF-8 text piece; 0x05 a UTF-8
error, sent before the socket closes with the same text as its reason. Client to server:
0x01 Ogg/Opus audio. The other kinds of the protocol (0x00 handshake, 0x03 control, 0x04
metadata, 0x05 error, 0x06 ping) mean nothing to this server and are ignored; 0x02 text and
unknown kinds are refused.

Query parameters applied (docs/gateway.md): text_prompt, voice_prompt, seed (else
audio_seed; -1: random), audio_temperature / audio_topk (TEMPERATURE / TOP_K),
text_temperature / text_topk (TEMPERATURE_TEXT / TOP_K_TEXT), within the talker's ranges
(it names a value outside them). Accepted and ignored: text_seed (the talker draws text and
audio from one seed), pad_mult, repetition_penalty, repetition_penalty_context (the talker
has no such sampling), worker_auth_id, email (PersonaPlex's hosted service's).
"""

from __future__ import annotations

import asyncio
import time
from typing import Mapping

import aiohttp
import numpy as np
import sphn
from aiohttp import web
from personaplex_stream import Persona, contract

from .conversation import GatewayContext, pump_answers, refuse, stop
from .limits import CLOSE_UNSUPPORTED_DATA, GatewayError
from .triton_session import Answer, TritonSession
from .voices import VoiceCatalog

KIND_HANDSHAKE = 0x00
KIND_AUDIO = 0x01
KIND_TEXT = 0x02
KIND_ERROR = 0x05
IGNORED_KINDS = frozenset({0x00, 0x03, 0x04, 0x05, 0x06})

# query parameter -> (Persona field, type)
APPLIED = {"audio_temperature": ("temperature", float), "audio_topk": ("top_k", int),
           "text_temperature": ("temperature_text", float), "text_topk": ("top_k_text", int)}
# Any other parameter (PersonaPlex's page also sends text_seed, pad_mult, repetition_penalty,
# repetition_penalty_context, worker_auth_id, email, token) is accepted and has no effect.


def _number(query: Mapping[str, str], name: str, kind):
    try:
        return kind(query[name])
    except ValueError:
        raise GatewayError("invalid_parameter", f"{name} must be {'an integer' if kind is int else 'a number'}, "
                           f"got {query[name]!r}") from None


def persona_from_query(query: Mapping[str, str], voices: VoiceCatalog) -> Persona:
    """The persona a /api/chat request asks for; GatewayError naming a bad parameter."""
    persona = Persona(voice=voices.resolve(query.get("voice_prompt")),
                      text_prompt=query.get("text_prompt") or None)
    seed_name = "seed" if "seed" in query else "audio_seed" if "audio_seed" in query else None
    if seed_name is not None:
        seed = _number(query, seed_name, int)
        if not -1 <= seed < 2**63:
            raise GatewayError("invalid_parameter", f"{seed_name} must lie in [0, 2**63) or be -1 (random), got {seed}")
        persona.seed = None if seed == -1 else seed
    for name, (field, kind) in APPLIED.items():
        if name in query:
            setattr(persona, field, _number(query, name, kind))
    return persona


def message_kind(data: bytes) -> tuple[int, bytes]:
    """A client message's kind and payload; GatewayError for one this server refuses."""
    if not data:
        raise GatewayError("bad_message", "an empty message: every message starts with a 1-byte kind",
                           CLOSE_UNSUPPORTED_DATA)
    kind = data[0]
    if kind != KIND_AUDIO and kind not in IGNORED_KINDS:
        raise GatewayError("bad_kind", f"message kind 0x{kind:02x} is not accepted from a client "
                           "(0x01: Ogg/Opus audio)", CLOSE_UNSUPPORTED_DATA)
    return kind, data[1:]


async def serve_chat(ws: web.WebSocketResponse, query: Mapping[str, str], ctx: GatewayContext) -> None:
    """One /api/chat conversation on a prepared WebSocket, until either side ends it."""

    async def send_error(error: GatewayError) -> None:
        await ws.send_bytes(bytes([KIND_ERROR]) + error.message.encode("utf-8"))

    session: TritonSession | None = None
    pump: asyncio.Task | None = None
    try:
        session = ctx.session(persona_from_query(query, ctx.voices))
        await session.start()
        await ws.send_bytes(bytes([KIND_HANDSHAKE]))
        opus_in = sphn.OpusStreamReader(contract.SAMPLE_RATE)
        opus_out = sphn.OpusStreamWriter(contract.SAMPLE_RATE)

        loop = asyncio.get_running_loop()

        async def send_answer(answer: Answer) -> None:
            # Encoding a frame costs 1.5-3 ms of CPU (sphn releases the GIL): in a worker thread, the
            # event loop goes on with the other conversations meanwhile. This conversation's
            # answers are encoded one at a time, in order, as its writer needs.
            ogg = await loop.run_in_executor(None, opus_out.append_pcm, answer.pcm)
            if len(ogg):
                await ws.send_bytes(bytes([KIND_AUDIO]) + bytes(ogg))
            if answer.text:
                await ws.send_bytes(bytes([KIND_TEXT]) + answer.text.encode("utf-8"))
            ctx.timings.outbound_ms.append((time.perf_counter() - answer.received_at) * 1e3)
            ctx.timings.frames_out += 1

        pump = asyncio.ensure_future(pump_answers(session, send_answer, lambda e: refuse(ws, e, send_error)))
        async for message in ws:
            received_at = time.perf_counter()
            if message.type == aiohttp.WSMsgType.ERROR:
                break
            if message.type != aiohttp.WSMsgType.BINARY:
                raise GatewayError("bad_message", "/api/chat takes binary messages only (a 1-byte kind, then "
                                   "its payload)", CLOSE_UNSUPPORTED_DATA)
            ctx.limits.check_message(len(message.data))
            kind, payload = message_kind(message.data)
            if kind == KIND_AUDIO:
                try:
                    pcm = opus_in.append_bytes(payload)
                except Exception as exc:  # sphn raises its own kinds for a stream it cannot read
                    raise GatewayError("bad_audio", f"the audio is not a readable Ogg/Opus stream: {exc}",
                                       CLOSE_UNSUPPORTED_DATA) from None
                if np.size(pcm):
                    session.feed(np.asarray(pcm, np.float32), received_at)
    except GatewayError as error:
        await refuse(ws, error, send_error)
    finally:
        await stop(pump)
        if session is not None:
            await session.close()
