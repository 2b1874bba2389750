"""The errors raised while streaming a conversation, and what tritonclient's errors say."""

from __future__ import annotations

from tritonclient.utils import InferenceServerException


class StreamError(RuntimeError):
    """Base class of the errors raised while streaming a conversation."""


class ServerUnreachableError(StreamError):
    """The Triton server could not be reached at the given url."""


class ServerError(StreamError):
    """The server answered with an error (its message is the exception's message)."""


class ConnectionLostError(StreamError):
    """The stream broke mid-conversation: the server (or the balancer before it) went away."""


class StreamTimeoutError(StreamError):
    """The server stopped answering: no response within the timeout."""


class ProtocolError(StreamError):
    """The server's responses do not follow the wire contract."""


def error_text(error) -> str:
    """The message of a tritonclient error, or of any other exception."""
    if isinstance(error, InferenceServerException):
        return error.message() or str(error)
    return str(error)


def grpc_status(error):
    """The gRPC status of a transport error; None for an error the model sent in a response."""
    return error.status() if isinstance(error, InferenceServerException) else None


def is_unavailable(error) -> bool:
    """Whether a transport error says the server cannot be reached (gRPC UNAVAILABLE)."""
    status = grpc_status(error)
    return status is not None and "UNAVAILABLE" in str(status)
