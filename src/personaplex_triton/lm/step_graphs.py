"""The slot generator's step under CUDA graphs, one graph per (batch bucket, top-k bucket).

On GPUs eager PyTorch is launch-bound (an eager step of the 7B model takes many times as long
as its graph), so the whole step, the unpacking of its inputs, the token grid's
bookkeeping, the embeddings and the model, is one launch. The buckets (buckets.py) set the
graphs' shapes; every graph is captured when the model loads (graph_capture.py). A step's
inputs arrive as one packed tensor (step_inputs.py) and its embeddings, copied into the graph's
own buffers (the embeddings only when given: the packed `EMBED` column says whether a row reads
them); the graph's outputs are its own buffers, which its next replay overwrites. Off CUDA, or
with graphs off, the step runs as it is.
"""

from __future__ import annotations

from typing import Callable

import torch
from moshi.utils.compile import no_cuda_graph

from ..core.collector import paused
from ..core.host_copies import copy_into, to_device
from .step_inputs import ACTIVE


def capture(warm_up: Callable, body: Callable, device, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """A CUDA graph of `body()` (in the graph memory pool `pool`, None: its own), after
    `warm_up()` on a side stream, as capture requires; moshi's own graphs stay out of both.
    Returns the graph and what `body` returned (its outputs, which each replay overwrites).
    No garbage collection runs meanwhile (`collector.paused`)."""
    with paused():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), no_cuda_graph():
            warm_up()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool), no_cuda_graph():
            outputs = body()
    return graph, outputs


class GraphedCall:
    """`body(*inputs)` replayed as one CUDA graph over fixed input buffers, for a call of many
    small kernels that runs between ticks (a start's reset, its prefill's embeddings): eager,
    each kernel is a launch from a host the other processes share. A call copies its arguments
    into the buffers' first rows and replays; its result is the graph's own outputs, which the
    next call overwrites. Arguments longer than the buffers, and every call with graphs off,
    run `body` eagerly. The capture's warm-up runs `body` on the buffers as given: they must
    hold arguments that change nothing (a mask of no slot)."""

    def __init__(self, body: Callable, inputs: tuple[torch.Tensor, ...], enabled: bool):
        self.body, self.inputs, self.graph = body, inputs, None
        if enabled:
            self.graph, self.outputs = capture(lambda: body(*inputs), lambda: body(*inputs), inputs[0].device)

    def __call__(self, *args: torch.Tensor):
        device = self.inputs[0].device
        if self.graph is None or any(len(a) > len(b) for a, b in zip(args, self.inputs)):
            return self.body(*(to_device(a, device) for a in args))
        for buffer, value in zip(self.inputs, args):
            copy_into(buffer[:len(value)], value)
        self.graph.replay()
        return self.outputs


class _Graph:
    """One captured step: its input buffers and its outputs."""

    def __init__(self, step: Callable, packed: torch.Tensor, embeddings: torch.Tensor):
        self.packed, self.embeddings = packed.clone(), embeddings.clone()
        idle = self.packed.clone()
        idle[:, ACTIVE] = 0  # no row steps: the warm-up leaves every slot as it was
        self.graph, self.outputs = capture(lambda: step(idle, self.embeddings),
                                           lambda: step(self.packed, self.embeddings), packed.device)

    def __call__(self, packed: torch.Tensor, embeddings: torch.Tensor | None):
        copy_into(self.packed, packed)
        if embeddings is not None:
            copy_into(self.embeddings, embeddings)
        self.graph.replay()
        return self.outputs


class StepGraphs:
    def __init__(self, step: Callable, enabled: bool, no_embeddings: Callable[[int], torch.Tensor]):
        """`step(packed, embeddings)`: the generator's (SlotGenerator._step), on the device's
        tensors; `enabled`: under CUDA graphs; `no_embeddings(b)`: b rows' embeddings when a
        step gives none (zeros on the device)."""
        self.step = step
        self.enabled = enabled
        self._no_embeddings = no_embeddings
        self._graphs: dict[tuple[int, int, int], _Graph] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: tuple[int, int, int], packed: torch.Tensor, embeddings: torch.Tensor | None):
        """The step of `packed` [b, COLUMNS] (on any device) and `embeddings` [b, 1, dim] (None:
        no row embeds); `key`: (b, a batch bucket under graphs, and the top-k bounds). Its
        graph is captured on first use."""
        b = packed.shape[0]
        if not self.enabled:
            zeros = self._no_embeddings(b)
            return self.step(packed.to(zeros.device), zeros if embeddings is None else embeddings.to(zeros.device))
        graph = self._graphs.get(key)
        if graph is None:
            no_embeddings = self._no_embeddings(b)
            graph = self._graphs[key] = _Graph(self.step, packed.to(no_embeddings.device), no_embeddings)
        return graph(packed, embeddings)

    def clear(self) -> None:
        self._graphs.clear()
