"""The exceptions a stage's tick raises to tell the engine how far a failure reaches: one
conversation (`SlotFault`), or every conversation of a tick that cannot be stepped again
(`StepNotRepeatable`). Both cross a stage's pipe (engine/stage_process.py) pickled."""

from __future__ import annotations


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
