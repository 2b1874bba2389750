"""PersonaPlex served on Triton Inference Server.

Importing the package is cheap (no torch). The wire contract and the audio helpers a client
needs live in the client package, `personaplex_stream` (client/), which installs on its own.
Its subpackages import only downwards, serving > stages > engine > lm | mimi > core, lm and
mimi apart (the import-linter contracts in pyproject.toml; `make test` checks them).
"""

__version__ = "0.1.0"
