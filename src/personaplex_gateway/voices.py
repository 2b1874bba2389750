"""The voices the gateway offers: named on its command line, or read from the checkpoint
folder that Triton serves (its `voices/` folder of NAME.pt / NAME.wav prompts, or the
`voices.tgz` archive holding it, as PersonaPlex publishes them)."""

from __future__ import annotations

import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .limits import GatewayError

VOICE_SUFFIXES = (".pt", ".wav")
DEFAULT_PROMPT = "You enjoy having a good conversation."


def voices_in_checkpoint(folder: Path) -> list[str]:
    """The voice names of a local checkpoint folder; ValueError where it has none."""
    folder = Path(folder)
    if (folder / "voices").is_dir():
        names = {p.stem for p in (folder / "voices").iterdir() if p.suffix in VOICE_SUFFIXES}
    elif (folder / "voices.tgz").is_file():
        with tarfile.open(folder / "voices.tgz") as archive:
            names = {PurePosixPath(m.name).stem for m in archive.getmembers()
                     if m.isfile() and PurePosixPath(m.name).suffix in VOICE_SUFFIXES}
    else:
        raise ValueError(f"{folder} has no voices/ folder or voices.tgz")
    if not names:
        raise ValueError(f"{folder}'s voices hold no .pt or .wav voice prompt")
    return sorted(names)


def voice_name(requested: str) -> str:
    """A voice as a client names it, PersonaPlex's file name ("NATF2.pt") or the bare name."""
    path = PurePosixPath(requested.strip())
    if path.name != requested.strip() or not path.name:
        raise GatewayError("unknown_voice", f"a voice is a name such as NATF0, got {requested!r}")
    return path.stem if path.suffix in VOICE_SUFFIXES else path.name


@dataclass(frozen=True)
class VoiceCatalog:
    """names: the voices known (empty: not known here; the server judges each request);
    default_voice: used where a client names none (None: the server's default)."""

    names: tuple = ()
    default_voice: str | None = None
    default_prompt: str = DEFAULT_PROMPT

    @classmethod
    def of(cls, names, default_voice: str | None = None, default_prompt: str = DEFAULT_PROMPT) -> "VoiceCatalog":
        names = tuple(names)
        if default_voice is not None and names and default_voice not in names:
            raise ValueError(f"the default voice {default_voice!r} is not one of {', '.join(names)}")
        if default_voice is None and names:
            default_voice = "NATF0" if "NATF0" in names else names[0]
        return cls(names, default_voice, default_prompt)

    def resolve(self, requested: str | None) -> str | None:
        """The voice to send for a client's request (None or "": the default)."""
        if requested is None or not requested.strip():
            return self.default_voice
        name = voice_name(requested)
        if self.names and name not in self.names:
            raise GatewayError("unknown_voice", f"unknown voice {name!r}; this server has: {', '.join(self.names)}")
        return name

    def as_json(self) -> dict:
        return {"voices": list(self.names), "default_voice": self.default_voice, "default_prompt": self.default_prompt}
