"""The wire contract, under the server library's name. Its one source is the client package's
`personaplex_stream.contract`: the client installs on its own, without this package."""

from personaplex_stream.contract import *  # noqa: F401,F403
