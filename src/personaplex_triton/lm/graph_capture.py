"""Every CUDA graph the slot generator's step can use, captured when the model loads, so that
nothing a client sends makes the server capture another (step_graphs.py holds them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..core import loaders
from .step_inputs import StepInputs
from .token_grid import NUM_AUDIO

if TYPE_CHECKING:
    from .generation import SlotGenerator


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
