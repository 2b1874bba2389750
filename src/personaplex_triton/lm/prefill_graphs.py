"""A persona prefill's transformer passes (prefill.py), under CUDA graphs: PREFILL_CHUNK
positions a pass and the rest in one (`pass_lengths`), each length with its graph, captured at
load, over whichever slot its slot table names.

Eager on a GPU, a pass of the 7B model is launch-bound: it takes about as long whatever its
length, and longer still the first time a length is seen, while the live conversations' ticks
wait for it. A graph replays in the time its kernels take, so a prefill costs its count of
passes (a graph for each length up to PREFILL_CHUNK, not for powers of two only, which would
split a prefill into more passes). Inside the graph the slot's streaming state and its KV ring
are gathered into one-row buffers, the pass runs there, and they are written back
(slot_states.CarriedRows). The buffers hold a whole ring, so the pass runs the eager pass's
kernels on the same shapes and the slot's state comes out bit for bit as an eager pass leaves
it (tests/test_gpu.py); but only the ring's head moves in and out, the first `head` entries
(tunables.MAX_PREFILL_POSITIONS): a freshly reset slot's ring is empty, a prefill fills no more
than that, and moshi's attention masks every entry past the slot's end, so what the buffers
hold there never counts (gathering and writing back the whole ring made every pass longer).
Off CUDA, with graphs off, past the head or of a length captured for none, a pass runs eagerly
on the slot's own row. The measurements are in docs/decisions.md.
"""

from __future__ import annotations

import torch

from ..core import tunables
from .slot_states import SlotStates
from .step_graphs import capture

# Prefill positions per transformer pass at most, a chunk of a prefill: a PersonaPlex prefill (a
# voice prompt, silences, the role prompt) is a few hundred positions, so a few passes, each
# holding the live conversations' ticks for a chunk.
PREFILL_CHUNK = 64


def pass_lengths(positions: int) -> list[int]:
    """The passes of a prefill of `positions`: PREFILL_CHUNK each, then the rest in one."""
    return [min(PREFILL_CHUNK, positions - start) for start in range(0, positions, PREFILL_CHUNK)]


def all_pass_lengths() -> list[int]:
    """Every length `pass_lengths` gives, longest first."""
    return list(range(PREFILL_CHUNK, 0, -1))


class PrefillPasses:
    def __init__(self, lm, states: SlotStates, enabled: bool):
        """`lm`: the streaming LMModel whose temporal transformer the passes run; `states`: its
        slots' streaming states; `enabled`: under CUDA graphs."""
        self.lm, self.states, self.enabled = lm, states, enabled
        self.head = min(tunables.MAX_PREFILL_POSITIONS, lm.context)  # the ring entries a graphed pass moves
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if enabled:
            self._carried = states.one_slot()
            self._slot = torch.zeros(1, dtype=torch.long, device=lm.device)
            self._active = torch.zeros(1, dtype=torch.bool, device=lm.device)
            self._pool = torch.cuda.graph_pool_handle()  # the passes run one at a time: one pool for all

    def __len__(self) -> int:
        return len(self._graphs)

    def lengths(self, positions: int) -> list[int]:
        """The passes of a prefill of `positions` (`pass_lengths`), graphed or eager alike."""
        return pass_lengths(positions)

    def run(self, slot: int, chunk: torch.Tensor, end: int) -> None:
        """One pass of `chunk` [1, T, dim] (the steps' input embeddings) into `slot`, after
        which its prefill has filled `end` positions."""
        graphed = self._graphs.get(chunk.shape[1]) if end <= self.head else None
        if graphed is None:
            exec_mask = torch.zeros(self.states.num_slots, dtype=torch.bool, device=chunk.device)
            exec_mask[slot] = True
            self.lm.set_exec_mask(exec_mask)
            with self.states.slot(slot):
                self.lm.transformer(chunk)
            return
        graph, inputs = graphed
        self._slot.fill_(slot)
        inputs.copy_(chunk)
        graph.replay()

    def capture(self) -> int:
        """Capture the graph of each pass length, at load, before any conversation starts: the
        captures run on slot 0 (moving it on by nothing, but writing past its end)."""
        for length in all_pass_lengths() if self.enabled else ():
            if length not in self._graphs:
                self._graphs[length] = self._capture(length)
        return len(self)

    def _pass(self, inputs: torch.Tensor) -> None:
        self._carried.load(self._slot, self._active, filled=self.head)
        with self._carried.seen():
            self.lm.transformer(inputs)
        self._carried.store(filled=self.head - 1)  # store writes one past `filled` (a step's new entry)

    def _capture(self, length: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        inputs = torch.zeros(1, length, self.lm.dim, device=self.lm.device, dtype=next(self.lm.parameters()).dtype)
        self._active.fill_(False)  # the warm-up moves no slot on (it writes ring entries past the end, unread)
        graph, _ = capture(lambda: self._pass(inputs), lambda: self._pass(inputs), self.lm.device, self._pool)
        self._active.fill_(True)
        return graph, inputs

    def clear(self) -> None:
        self._graphs.clear()
