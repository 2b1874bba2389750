"""personaplex-gateway: serve PersonaPlex on Triton to browsers and agent frameworks over
WebSockets (PersonaPlex's /api/chat, a Realtime-style /v1/realtime) and a page at /."""

from __future__ import annotations

import argparse
import logging
import os
import ssl
import sys
from pathlib import Path

from aiohttp import web

from .app import STATIC_DIR, GatewayConfig, make_app
from .limits import Limits
from .triton_session import TritonTLS
from .voices import DEFAULT_PROMPT, VoiceCatalog, voices_in_checkpoint

DEFAULT_CHECKPOINT = Path("checkpoints") / "tiny"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="personaplex-gateway", description=__doc__.splitlines()[0])
    p.add_argument("--triton-url", default="localhost:8001", help="Triton's gRPC endpoint (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s; 0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--static", type=Path, default=STATIC_DIR, metavar="DIR",
                   help="serve DIR's index.html and files at / (default: the gateway's own page)")
    p.add_argument("--voices", help="the voices offered, comma-separated (default: those of --checkpoint)")
    p.add_argument("--checkpoint", type=Path,
                   help="the checkpoint folder Triton serves, to read its voices from (default: "
                        "$PERSONAPLEX_CHECKPOINT where it is a folder, else ./checkpoints/tiny)")
    p.add_argument("--default-voice", help="the voice of a client that names none (default: NATF0, or the first)")
    p.add_argument("--default-prompt", default=DEFAULT_PROMPT, help="the role prompt the page suggests")
    p.add_argument("--origins", default="",
                   help="comma-separated Origin values allowed to open a socket, or '*' (default: "
                        "same-origin pages, and clients that send no Origin)")
    p.add_argument("--token", default=os.environ.get("PERSONAPLEX_GATEWAY_TOKEN"),
                   help="require this bearer token of every client (default: $PERSONAPLEX_GATEWAY_TOKEN; unset: none)")
    p.add_argument("--max-connections", type=int,
                   help="conversations at once (default: the stages' max_conversations where they are numbers, else 64)")
    p.add_argument("--max-message-bytes", type=int, default=Limits.max_message_bytes)
    p.add_argument("--audio-burst-s", type=float, default=Limits.audio_burst_s,
                   help="audio ahead of real time that goes to Triton at once (default %(default)s s)")
    p.add_argument("--audio-max-ahead-s", type=float, default=Limits.audio_max_ahead_s,
                   help="audio held back beyond the burst before the client is refused (default %(default)s s)")
    p.add_argument("--unsent-max-s", type=float, default=Limits.unsent_max_s,
                   help="the agent's audio held unsent, the client not reading it, before the conversation "
                        "ends (default %(default)s s)")
    p.add_argument("--tls-cert", type=Path, help="serve HTTPS / WSS with this certificate (PEM) ...")
    p.add_argument("--tls-key", type=Path, help="... and this private key")
    p.add_argument("--triton-tls", action="store_true", help="reach Triton over TLS")
    p.add_argument("--triton-ca", help="the CA certificate that signed Triton's (default: the system's)")
    p.add_argument("--triton-client-cert", help="the gateway's certificate, for mutual TLS with Triton")
    p.add_argument("--triton-client-key", help="the gateway's private key, for mutual TLS with Triton")
    return p.parse_args(argv)


def voice_catalog(args: argparse.Namespace) -> VoiceCatalog:
    if args.voices:
        names = [name.strip() for name in args.voices.split(",") if name.strip()]
    else:
        env = os.environ.get("PERSONAPLEX_CHECKPOINT")
        folder = args.checkpoint or (Path(env) if env and Path(env).is_dir() else DEFAULT_CHECKPOINT)
        names = voices_in_checkpoint(folder)
    return VoiceCatalog.of(names, args.default_voice, args.default_prompt)


def config_of(args: argparse.Namespace) -> GatewayConfig:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if not (args.static / "index.html").is_file():
        raise ValueError(f"--static {args.static} has no index.html")
    tls = None
    if args.triton_tls or args.triton_ca or args.triton_client_cert:
        if (args.triton_client_cert is None) != (args.triton_client_key is None):
            raise ValueError("--triton-client-cert and --triton-client-key go together")
        tls = TritonTLS(args.triton_ca, args.triton_client_key, args.triton_client_cert)
    origins = tuple(o.strip().rstrip("/") for o in args.origins.split(",") if o.strip())
    limits = Limits(args.max_connections or 64, args.max_message_bytes, args.audio_burst_s, args.audio_max_ahead_s,
                    args.unsent_max_s)
    return GatewayConfig(triton_url=args.triton_url, triton_tls=tls, voices=voice_catalog(args),
                         static_dir=args.static, origins=origins, token=args.token or None,
                         max_connections=args.max_connections, limits=limits)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_of(args)
    except ValueError as exc:
        print(f"personaplex-gateway: {exc}", file=sys.stderr)
        return 2
    tls = None
    if args.tls_cert is not None:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    scheme = "https" if tls else "http"
    print(f"personaplex-gateway: {scheme}://{args.host}:{args.port}/ -> Triton {args.triton_url}; "
          f"voices {', '.join(config.voices.names)}", flush=True)
    web.run_app(make_app(config), host=args.host, port=args.port, ssl_context=tls, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
