"""Faults injected on purpose, to test against the real server that one conversation's failure
stays its own. Off unless $PERSONAPLEX_INJECT_FAULTS is set; never set it in production.

The variable lists `kind:conversation-id` pairs, comma-separated:
- `tick:7`: every step that includes conversation 7 fails, naming its slot (`SlotFault`);
- `flaky-tick:8`: the first step that includes conversation 8 fails once, naming no one;
- `broken-tick:9`: every step that includes conversation 9 fails, naming no one;
- `send:10`: sending conversation 10's frames fails, as with a sender whose client is gone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .errors import SlotFault

INJECT_FAULTS_ENV = "PERSONAPLEX_INJECT_FAULTS"
KINDS = ("tick", "flaky-tick", "broken-tick", "send")


class InjectedFault(RuntimeError):
    pass


@dataclass
class FaultPlan:
    faults: dict[int, str] = field(default_factory=dict)  # conversation id -> kind

    @classmethod
    def parse(cls, spec: str) -> "FaultPlan":
        plan = cls()
        for entry in filter(None, (part.strip() for part in spec.split(","))):
            kind, _, key = entry.partition(":")
            if kind not in KINDS or not key.isdigit():
                raise ValueError(f"{INJECT_FAULTS_ENV}: {entry!r} is not one of {', '.join(KINDS)} followed by :id")
            plan.faults[int(key)] = kind
        return plan

    @classmethod
    def from_env(cls) -> "FaultPlan | None":
        spec = os.environ.get(INJECT_FAULTS_ENV, "")
        return cls.parse(spec) if spec else None

    def before_tick(self, slots_by_key: dict[int, int]) -> None:
        for key, slot in slots_by_key.items():
            kind = self.faults.get(key)
            if kind == "tick":
                raise SlotFault(slot, f"injected fault in conversation {key}'s step")
            if kind in ("flaky-tick", "broken-tick"):
                if kind == "flaky-tick":
                    del self.faults[key]
                raise InjectedFault(f"injected {kind} fault")

    def before_send(self, key: int) -> None:
        if self.faults.get(key) == "send":
            raise InjectedFault(f"injected send fault in conversation {key}")
