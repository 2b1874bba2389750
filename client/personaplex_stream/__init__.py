"""personaplex_stream: a light client (numpy + tritonclient, no torch, no scipy) that streams
a conversation to PersonaPlex served on Triton Inference Server. Installs on its own
(`pip install ./client`); it also holds the wire contract (`contract`), which the server
library imports from here.

    from personaplex_stream import Persona, stream_conversation
    from personaplex_stream.audio import read_wav, write_wav

    result = stream_conversation(read_wav("user.wav"), url="localhost:8001",
                                 persona=Persona(voice="NATF0", text_prompt="You are ..."))
    write_wav("agent.wav", result.audio)
    print(result.text, result.summary())
"""

from .answers import AnsweredFrame, is_final_response
from .connection import DEFAULT_URL
from .errors import (
    ConnectionLostError,
    ProtocolError,
    ServerError,
    ServerUnreachableError,
    StreamError,
    StreamTimeoutError,
)
from .live import LiveLine
from .report import ConversationResult, latency_percentiles
from .request import Persona, build_end_inputs, build_persona_inputs, build_request_inputs, new_sequence_id
from .stream import stream_conversation

__all__ = [
    "DEFAULT_URL",
    "AnsweredFrame",
    "ConnectionLostError",
    "ConversationResult",
    "LiveLine",
    "Persona",
    "ProtocolError",
    "ServerError",
    "ServerUnreachableError",
    "StreamError",
    "StreamTimeoutError",
    "build_end_inputs",
    "build_persona_inputs",
    "build_request_inputs",
    "is_final_response",
    "latency_percentiles",
    "new_sequence_id",
    "stream_conversation",
]
