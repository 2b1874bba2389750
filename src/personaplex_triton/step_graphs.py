"""The slot generator's step under CUDA graphs, one graph per (batch bucket, top-k bucket).

On GPUs eager PyTorch is launch-bound (about 180 ms a step for the 7B model on an H200, against
about 15 ms with graphs), so the whole step, the token grid's bookkeeping, the embeddings and
the model, is one launch. The buckets (buckets.py) set the graphs' shapes; `capture_graphs`
captures every one when the model loads, so nothing a client sends makes the server capture
another. Off CUDA, or with graphs off, the cache holds the step as it is (moshi's `CUDAGraphed`
disabled).
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Callable

import torch
from moshi.utils.compile import CUDAGraphed

from . import loaders
from .step_inputs import StepInputs
from .token_grid import NUM_AUDIO

if TYPE_CHECKING:
    from .generation import SlotGenerator


class StepGraphs:
    def __init__(self, step: Callable, enabled: bool):
        """`step`: the generator's (SlotGenerator._step); `enabled`: under CUDA graphs."""
        self.step = step
        self.enabled = enabled
        self._graphs: dict[tuple[int, int, int], CUDAGraphed] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def get(self, b: int, top_k_text_bound: int, top_k_bound: int) -> CUDAGraphed:
        """The step of the first `b` slots at these top-k bounds, its graph made on first use."""
        key = (b, top_k_text_bound, top_k_bound)
        if key not in self._graphs:
            # A CUDA graph freed while another is being captured (by a garbage collection of
            # some unclosed generator, say) invalidates that capture: collect before it.
            if self.enabled:
                gc.collect()
            self._graphs[key] = CUDAGraphed(self.step, disable=not self.enabled)
        return self._graphs[key]

    def clear(self) -> None:
        self._graphs.clear()


def capture_graphs(generator: SlotGenerator) -> int:
    """Capture every graph serving can use (each batch bucket x top-k bucket) by running a
    step with no slot active, which leaves every slot's state as it was. Returns how many."""
    if not generator.graphs.enabled:
        return 0
    bounds = (generator.top_k_text_bound, generator.top_k_bound)
    for b in generator.buckets:
        idle = _idle_inputs(b, generator.device)
        for generator.top_k_text_bound in loaders.TOP_K_TEXT_BUCKETS:
            for generator.top_k_bound in loaders.TOP_K_BUCKETS:
                for _ in range(2):  # moshi's CUDAGraphed: a warm-up call, then the capture
                    generator.step(idle)
    generator.top_k_text_bound, generator.top_k_bound = bounds
    return len(generator.graphs)


def _idle_inputs(b: int, device) -> StepInputs:
    """A step of b rows with none active: it changes no slot's state."""
    def zeros(*shape, dtype=torch.long):
        return torch.zeros(shape, dtype=dtype, device=device)
    return StepInputs(active=zeros(b, dtype=torch.bool), user_codes=zeros(b, NUM_AUDIO),
                      agent_codes=zeros(b, NUM_AUDIO), agent_forced=zeros(b, dtype=torch.bool),
                      text_token=zeros(b), text_forced=zeros(b, dtype=torch.bool))
