"""PersonaPlex served on Triton Inference Server.

Importing the package is cheap (no torch). The wire contract and the audio helpers a client
needs live in the client package, `personaplex_stream` (client/), which installs on its own.
"""

__version__ = "0.1.0"
