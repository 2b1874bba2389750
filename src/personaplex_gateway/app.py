"""The gateway's HTTP surface (aiohttp): the page, the voices, health, and the two WebSocket
protocols, behind the origin allow-list, the optional token and the connection cap.

    GET /              the page (static/, or --static DIR: another client's built files)
    GET /api/voices    {"voices": [...], "default_voice": ..., "default_prompt": ...}
    GET /healthz       200 when Triton and the ensemble are ready, else 503
    GET /stats         the gateway's own time per frame (FrameTimings), and conversations open
    WS  /api/chat      PersonaPlex's protocol (chat_protocol)
    WS  /v1/realtime   Realtime-style JSON events (realtime_protocol)
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from .chat_protocol import KIND_ERROR, serve_chat
from .conversation import GatewayContext, refuse
from .limits import ConnectionGate, GatewayError, Limits, bound_send_buffer
from .realtime_protocol import error_event, serve_realtime
from .triton_session import FrameTimings, TritonChannel, TritonTLS
from .voices import VoiceCatalog

log = logging.getLogger("personaplex_gateway")
STATIC_DIR = Path(__file__).parent / "static"
CONTEXT = web.AppKey("context", GatewayContext)


@dataclass(frozen=True)
class GatewayConfig:
    """triton_url: Triton's gRPC endpoint; triton_tls: None for a plain channel; origins: the
    Origin values allowed to open a socket ("*": any; empty: same-origin pages and clients
    that send no Origin); token: required of every client where set; max_connections: None
    matches the stages' slots where their configurations say a number, else `fallback_connections`
    (`limits.max_connections` is replaced by the cap so found)."""

    triton_url: str = "localhost:8001"
    triton_tls: TritonTLS | None = None
    voices: VoiceCatalog = VoiceCatalog()
    static_dir: Path = STATIC_DIR
    origins: tuple = ()
    token: str | None = None
    max_connections: int | None = None
    fallback_connections: int = 64
    limits: Limits = Limits()


def origin_allowed(origin: str | None, host: str | None, allowed: tuple) -> bool:
    if "*" in allowed or origin is None:
        return True
    if origin in allowed:
        return True
    return not allowed and host is not None and urlsplit(origin).netloc == host


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    if header.lower().startswith("bearer "):
        return header[len("bearer "):].strip()
    return request.query.get("token")


def check_access(request: web.Request, config: GatewayConfig) -> None:
    """HTTP 403 for an origin off the allow-list, 401 for a missing or wrong token."""
    origin = request.headers.get("Origin")
    if not origin_allowed(origin, request.host, config.origins):
        raise web.HTTPForbidden(text=f"origin {origin!r} is not allowed to connect to this gateway\n")
    if config.token is not None:
        given = bearer_token(request)
        if given is None or not hmac.compare_digest(given.encode(), config.token.encode()):
            raise web.HTTPUnauthorized(text="this gateway needs a token: an 'Authorization: Bearer' header "
                                            "or a token query parameter\n", headers={"WWW-Authenticate": "Bearer"})


def make_app(config: GatewayConfig) -> web.Application:
    app = web.Application()

    async def connect_triton(app: web.Application):
        channel = TritonChannel(config.triton_url, config.triton_tls)
        capacity = config.max_connections
        if capacity is None:
            slots = await channel.capacity()
            capacity = slots or config.fallback_connections
            log.info("connection cap %d (%s)", capacity, "the stages' conversation slots" if slots else
                     "a stage sizes its pool at load; --max-connections sets it")
        limits = dataclasses.replace(config.limits, max_connections=capacity)
        app[CONTEXT] = GatewayContext(channel, limits, config.voices, ConnectionGate(capacity), FrameTimings())
        yield
        await channel.close()

    app.cleanup_ctx.append(connect_triton)

    async def conversation(request: web.Request, serve, send_error) -> web.WebSocketResponse:
        check_access(request, config)
        ctx = request.app[CONTEXT]
        ws = web.WebSocketResponse(max_msg_size=ctx.limits.transport_max_bytes, heartbeat=30)
        await ws.prepare(request)
        bound_send_buffer(request)
        try:
            ctx.gate.enter()
        except GatewayError as error:
            await refuse(ws, error, lambda e: send_error(ws, e))
            return ws
        try:
            await serve(ws, ctx)
        finally:
            ctx.gate.leave()
            if not ws.closed:
                await ws.close()
        return ws

    async def chat(request: web.Request):
        return await conversation(request, lambda ws, ctx: serve_chat(ws, request.query, ctx),
                                  lambda ws, e: ws.send_bytes(bytes([KIND_ERROR]) + e.message.encode("utf-8")))

    async def realtime(request: web.Request):
        return await conversation(request, serve_realtime, lambda ws, e: ws.send_str(error_event(e)))

    async def voices(request: web.Request):
        return web.json_response(config.voices.as_json())

    async def healthz(request: web.Request):
        ready = await request.app[CONTEXT].channel.is_ready()
        return web.json_response({"ready": ready, "triton": config.triton_url}, status=200 if ready else 503)

    async def stats(request: web.Request):
        ctx = request.app[CONTEXT]
        return web.json_response({"conversations_open": ctx.gate.open, "connection_cap": ctx.gate.capacity,
                                  **ctx.timings.summary()})

    async def index(request: web.Request):
        return web.FileResponse(config.static_dir / "index.html")

    app.router.add_get("/api/chat", chat)
    app.router.add_get("/v1/realtime", realtime)
    app.router.add_get("/api/voices", voices)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/stats", stats)
    if (config.static_dir / "index.html").is_file():
        app.router.add_get("/", index)
        app.router.add_static("/", config.static_dir, follow_symlinks=False)
    else:
        log.warning("%s has no index.html: nothing is served at /", config.static_dir)
    return app
