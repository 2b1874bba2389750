"""A persona's prefill, played into a freshly started slot at once.

Every token of a prefill step is forced, so its samples are never used and the depformer need
not run: the token grid plays all the steps at once on a CPU copy of the slot's row
(`TokenGrid.play_forced`; step by step, a 7B persona's prefill spent half its time in the
grid's tiny ops), then the temporal transformer takes all the steps' input embeddings in
chunked passes, as an LLM takes a prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .generation import SlotGenerator

PREFILL_CHUNK = 256  # prefill positions per transformer pass


@torch.no_grad()
def prefill(generator: SlotGenerator, slot: int, tokens: torch.Tensor, embeddings: dict[int, torch.Tensor],
            restores: dict[int, torch.Tensor]) -> torch.Tensor:
    """Play a persona's prefill into a freshly started `slot` of `generator`: `tokens` [M, 17],
    every stream of every step forced, in the grid's order (text, agent's 8, user's 8);
    `embeddings`: step -> its input embedding [dim], in place of its tokens' (a voice bundle);
    `restores`: step -> a ring buffer the grid takes after it. Returns the input embeddings
    [M, 1, dim]."""
    if not len(tokens):
        return torch.zeros(0, 1, generator.lm.dim, device=generator.device)
    grid = generator.grid.row(slot, "cpu")
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
    inputs = generator.embed(torch.cat(previous).to(generator.device))  # [M, 1, dim]
    if embeddings:
        inputs[list(embeddings), 0] = torch.stack(list(embeddings.values())).to(inputs)
    exec_mask = torch.zeros(generator.num_slots, dtype=torch.bool, device=generator.device)
    exec_mask[slot] = True
    generator.lm.set_exec_mask(exec_mask)
    with generator.states.slot(slot):
        for chunk in inputs.transpose(0, 1).split(PREFILL_CHUNK, dim=1):
            generator.lm.transformer(chunk)
    return inputs
