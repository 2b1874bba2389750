"""Stages that a stage's process builds by name in tests (test_stage_process.py): the child
imports this module from tests/, which the tests put on its PYTHONPATH."""

import os

from personaplex_triton.core.errors import SlotFault
from personaplex_triton.engine.stage import Stage
from personaplex_triton.engine.prefills import PrefillJob


class EchoStage(Stage):
    """Each slot answers item x with (x, its process id, how many items it has seen). A tick
    with the item "fault" fails naming its slot; "exit" ends the process, as a crash would.
    A prefill's setup "chunks" is prefilled in three chunks; a setup "bad" cannot be. A tick with
    the item "unsendable" answers what cannot be pickled, "unsendable event" emits it; stopping
    slot -1 fails."""

    def __init__(self, num_slots, emit):
        self.num_slots = num_slots
        self.emit = emit
        self.seen = [0] * num_slots
        self.stopped = []

    def prefill_many(self, setups):
        failed = {}
        for slot, setup in setups.items():
            if setup == "bad":
                failed[slot] = ValueError(f"slot {slot}: a bad setup")
            else:
                self.seen[slot] = 0
                self.emit("started", slot)
        return failed

    def begin_prefills(self, setups):
        if "chunks" not in setups.values():
            return PrefillJob.at_once(self.prefill_many, setups)

        def chunks(failed):
            for _ in range(2):
                yield
            failed.update(self.prefill_many(setups))
        return PrefillJob(chunks)

    def stop(self, slot):
        if slot < 0:
            raise IndexError(f"no slot {slot}")
        self.stopped.append(slot)

    def tick(self, items):
        out = {}
        for slot, item in items.items():
            if item == "fault":
                raise SlotFault(slot, f"slot {slot} cannot step")
            if item == "exit":
                os._exit(3)
            if item == "unsendable":
                out[slot] = lambda: None
                continue
            if item == "unsendable event":
                self.emit("unsendable", lambda: None)
                out[slot] = "emitted"
                continue
            if item == "stopped":
                out[slot] = list(self.stopped)
                continue
            self.seen[slot] += 1
            out[slot] = (item, os.getpid(), self.seen[slot])
        return out


def _refuse_to_be_read():
    raise ValueError("this object cannot be read in the stage's process")


class Unreadable:
    """Pickles here; unpickling it (in the child) raises."""

    def __reduce__(self):
        return _refuse_to_be_read, ()


def build_echo(num_slots, emit):
    return EchoStage(num_slots, emit), {"pid": os.getpid()}


def build_failing(emit):
    raise RuntimeError("this stage cannot be built")
