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

INJECT_FAULTS_ENV = "PERSONAPLEX_INJECT_FAULTS"
KINDS = ("tick", "flaky-tick", "broken-tick", "send")


class StepNotRepeatable(RuntimeError):
    """Raised by a stage's tick that failed after its state moved (stages/speech.py: the talker
    stepped, then the decode failed): stepping again would step those conversations twice, so
    the engine ends them instead of retrying. `out_of_memory`: the failure was the GPU's memory."""

    def __init__(self, message: str, out_of_memory: bool = False):
        # both in args: from a stage's process it crosses the pipe pickled, rebuilt from its args
        super().__init__(message, out_of_memory)
        self.out_of_memory = out_of_memory

    def __str__(self) -> str:
        return self.args[0]


class SlotFault(RuntimeError):
    """Raised by a stage's tick when it knows which slot's input made the step fail."""

    def __init__(self, slot: int, message: str):
        super().__init__(message)
        self.slot = slot

    def __reduce__(self):  # crosses a stage's pipe (engine/stage_process.py) whole
        return type(self), (self.slot, str(self))


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
