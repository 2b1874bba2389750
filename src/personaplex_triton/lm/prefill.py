"""A persona's prefill, played into a freshly reset slot in chunks.

Every token of a prefill step is forced, so its samples are never used and the depformer need
not run: the token grid plays all the steps at once on a CPU copy of the slot's row
(`TokenGrid.play_forced`; step by step, a 7B persona's prefill spent half its time in the
grid's tiny ops), then the temporal transformer takes all the steps' input embeddings in
passes, as an LLM takes a prompt, each under a CUDA graph on a GPU (prefill_graphs.py).
`prefill_chunks` yields between passes, so that the engine can tick the live conversations
between them (engine/prefills.py); `run_chunks` runs them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generator

import torch

from ..core.host_copies import to_device

if TYPE_CHECKING:
    from .generation import SlotGenerator

def run_chunks(chunks: Generator):
    """Run a generator of chunks to its end; what it returns."""
    while True:
        try:
            next(chunks)
        except StopIteration as stop:
            return stop.value


@torch.no_grad()  # a generator's every chunk runs under it (torch's context decorators wrap generators)
def prefill_chunks(generator: SlotGenerator, slot: int, tokens: torch.Tensor, embeddings: dict[int, torch.Tensor],
                   restores: dict[int, torch.Tensor]) -> Generator[None, None, torch.Tensor]:
    """Play a persona's prefill into a freshly started `slot` of `generator`, yielding between
    transformer passes (the first runs in the caller's chunk, with the prefill's setup: on a GPU
    a chunk's work is queued, not waited for, so a pass adds only its graph's launch to the
    chunk, and a chunk less is two ticks less before the newcomer's first audio).

    `tokens` [M, 17], every stream of every step forced, in the grid's
    order (text, agent's 8, user's 8); `embeddings`: step -> its input embedding [dim], in place
    of its tokens' (a voice bundle); `restores`: step -> a ring buffer the grid takes after it.
    Returns the input embeddings [M, 1, dim]. Between chunks other slots may step: this slot's
    row is never among a step's carried rows (a graphed step pads its batch with rows that do
    not step), and each pass sets its execution mask anew."""
    if not len(tokens):
        return torch.zeros(0, 1, generator.lm.dim, device=generator.device)
    grid = generator.grid.fresh_row()  # the slot is freshly started: nothing to read back from the GPU
    previous, start = [], 0
    for end in sorted({*(step + 1 for step in restores), len(tokens)}):
        before, forced = grid.play_forced(tokens[start:end])
        if not bool(forced.all()):
            raise ValueError("a prefill step must force every stream")
        previous.append(before)
        if end - 1 in restores:
            grid.cache[0] = restores[end - 1]
        start = end
    generator.grid.put_row(slot, grid)
    inputs = generator.embed_prefill(torch.cat(previous))  # [M, 1, dim]
    if embeddings:
        steps = to_device(torch.tensor(list(embeddings)), inputs.device)
        inputs[steps, 0] = to_device(torch.stack(list(embeddings.values())), inputs.device).to(inputs)
    end = 0
    for i, chunk in enumerate(inputs.transpose(0, 1).split(generator.prefill.lengths(len(tokens)), dim=1)):
        if i:
            yield
        end += chunk.shape[1]
        generator.prefill.run(slot, chunk, end)
    return inputs
