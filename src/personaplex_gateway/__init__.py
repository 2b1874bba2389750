"""personaplex_gateway: WebSocket in front, Triton gRPC streams behind.

Browsers cannot open Triton's bidirectional gRPC stream, so this gateway takes one WebSocket
per conversation and turns it into one Triton sequence on the `ensemble` model: the audio
re-framed to 1920 samples and paced in, the answers sent back as they come. Two protocols:
PersonaPlex's own `/api/chat` (1-byte kinds, Ogg/Opus) and an OpenAI-Realtime-style
`/v1/realtime` (JSON events, base64 PCM16); a page of its own at `/` (docs/gateway.md).

It depends on tritonclient, aiohttp, sphn, numpy and the client package `personaplex_stream`,
never on the server library.
"""
