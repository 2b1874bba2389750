"""The slot generator's step under CUDA graphs, one graph per (batch bucket, top-k bucket).

On GPUs eager PyTorch is launch-bound (about 180 ms a step for the 7B model on an H200, against
about 15 ms with graphs), so the whole step, the token grid's bookkeeping, the embeddings and
the model, is one launch. The buckets (buckets.py) set the graphs' shapes; every graph is
captured when the model loads (graph_capture.py). Off CUDA, or with graphs off, the cache holds
the step as it is (moshi's `CUDAGraphed` disabled).
"""

from __future__ import annotations

import gc
from typing import Callable

from moshi.utils.compile import CUDAGraphed


class StepGraphs:
    def __init__(self, step: Callable, enabled: bool):
        """`step`: the generator's (SlotGenerator._step); `enabled`: under CUDA graphs."""
        self.step = step
        self.enabled = enabled
        self._graphs: dict[tuple[int, int, int], CUDAGraphed] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def get(self, b: int, top_k_text_bound: int, top_k_bound: int) -> CUDAGraphed:
        """The step of `b` rows (a batch bucket) at these top-k bounds, its graph made on first use."""
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
