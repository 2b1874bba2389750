"""Every CUDA graph the slot generator's step can use, captured when the model loads, so that
nothing a client sends makes the server capture another (step_graphs.py holds them).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..core import tunables
from .step_inputs import tick_inputs

if TYPE_CHECKING:
    from .generation import SlotGenerator

log = logging.getLogger(__name__)


def capture_graphs(generator: SlotGenerator) -> int:
    """Capture every graph serving can use (each batch bucket x top-k bucket) by running a
    step with no slot active, which leaves every slot's state as it was, and a prefill's pass
    of each length (prefill_graphs.py). Returns how many step graphs."""
    if not generator.graphs.enabled:
        return 0
    started = time.perf_counter()
    gc.collect()  # once: garbage still holding GPU memory is freed before the graphs take theirs
    bounds = (generator.top_k_text_bound, generator.top_k_bound)
    for b in generator.buckets:
        idle = torch.from_numpy(tick_inputs(np.arange(b), 0))  # no row steps: every slot stays as it was
        for generator.top_k_text_bound in tunables.TOP_K_TEXT_BUCKETS:
            for generator.top_k_bound in tunables.TOP_K_BUCKETS:
                generator.run_step(idle)
    generator.top_k_text_bound, generator.top_k_bound = bounds
    generator.prefill.capture()
    log.info("%d step graphs and %d prefill graphs captured in %.1f s", len(generator.graphs), len(generator.prefill),
             time.perf_counter() - started)
    return len(generator.graphs)
