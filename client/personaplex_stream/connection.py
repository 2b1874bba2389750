"""Opening a conversation's gRPC stream to Triton, and closing it: the client, the liveness and
readiness check, the bidirectional stream, and its stop (graceful when all went well)."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from .errors import ServerError, ServerUnreachableError, error_text

DEFAULT_URL = "localhost:8001"
STOP_GRACE_S = 5.0  # a graceful stop that takes longer is cancelled


def strip_scheme(url: str) -> str:
    """`url` as tritonclient's gRPC client takes it: "host:port", without a scheme."""
    for scheme in ("grpc://", "http://", "https://"):
        if url.startswith(scheme):
            return url[len(scheme) :]
    return url


@contextmanager
def open_stream(url: str, model_name: str, callback: Callable, *, check_ready: bool = True,
                connect_timeout_s: float = 10.0) -> Iterator[grpcclient.InferenceServerClient]:
    """A client of Triton at `url` ("host:port") with its stream started, responses going to
    `callback(result, error)`; first, unless `check_ready` is False, the server's liveness and
    `model_name`'s readiness, within `connect_timeout_s`. On leaving, the stream is stopped,
    gracefully if the body ended without an exception, and the client is closed."""
    try:
        client = grpcclient.InferenceServerClient(url=url)
    except InferenceServerException as exc:
        raise ServerUnreachableError(f"cannot connect to Triton at {url}: {error_text(exc)}") from None
    started = ok = False
    try:
        if check_ready:
            check_server_ready(client, url, model_name, connect_timeout_s)
        try:
            client.start_stream(callback=callback)
        except InferenceServerException as exc:
            raise ServerUnreachableError(f"cannot open a stream to Triton at {url}: {error_text(exc)}") from None
        started = True
        yield client
        ok = True
    finally:
        if started:
            stop_stream(client, graceful=ok)
        try:
            client.close()
        except Exception:
            pass


def check_server_ready(client: grpcclient.InferenceServerClient, url: str, model_name: str, timeout_s: float) -> None:
    """ServerUnreachableError unless the server is live, ServerError unless `model_name` is ready."""
    try:
        live = client.is_server_live(client_timeout=timeout_s)
    except InferenceServerException as exc:
        raise ServerUnreachableError(f"cannot reach Triton at {url}: {error_text(exc)}") from None
    if not live:
        raise ServerUnreachableError(f"Triton at {url} reports it is not live")
    try:
        ready = client.is_model_ready(model_name, client_timeout=timeout_s)
    except InferenceServerException as exc:
        raise ServerError(f"cannot query model {model_name!r} at {url}: {error_text(exc)}") from None
    if not ready:
        raise ServerError(f"model {model_name!r} is not ready on Triton at {url}")


def stop_stream(client, graceful: bool) -> None:
    """Stop the client's stream: gracefully (let the server finish) when `graceful`, and
    by cancelling it otherwise or when the graceful stop takes more than STOP_GRACE_S."""
    if graceful:
        stopper = threading.Thread(target=_quiet_stop, args=(client, False), daemon=True)
        stopper.start()
        stopper.join(STOP_GRACE_S)
        if not stopper.is_alive():
            return
    _quiet_stop(client, True)


def _quiet_stop(client, cancel: bool) -> None:
    try:
        client.stop_stream(cancel_requests=cancel)
    except Exception:
        pass
