"""A persona's prefill, played into a freshly started slot at once.

Every token of a prefill step is forced, so its samples are never used and the depformer need
not run: the token grid plays the steps on a CPU copy of the slot's row, then the temporal
transformer takes all the steps' input embeddings in chunked passes, as an LLM takes a prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .step_inputs import forced_tokens

if TYPE_CHECKING:
    from .generation import SlotGenerator

PREFILL_CHUNK = 256  # prefill positions per transformer pass


@torch.no_grad()
def prefill(generator: SlotGenerator, slot: int, steps: list) -> torch.Tensor:
    """Play a persona's prefill into a freshly started `slot` of `generator`. `steps`:
    (StepInputs of one row, every stream forced; a ring buffer to restore after the step, or
    None). Returns the input embeddings [M, 1, dim]."""
    if not steps:
        return torch.zeros(0, 1, generator.lm.dim, device=generator.device)
    grid, rows = generator.grid.row(slot, "cpu"), slice(0, 1)
    tokens, given = [], []
    for i, (inputs, restore_cache) in enumerate(steps):
        active = inputs.active.cpu()
        o, previous, target, target_provided = grid.read(rows, active, *forced_tokens(inputs, "cpu"))
        if not bool(target_provided.all()):
            raise ValueError("a prefill step must force every stream")
        grid.write(rows, o, active, target, target_provided)
        if restore_cache is not None:
            grid.cache[0] = restore_cache
        tokens.append(previous)
        if inputs.embeddings is not None:
            given.append((i, inputs.embeddings.view(1, -1)))
    generator.grid.put_row(slot, grid)
    embeddings = generator.embed(torch.cat(tokens).to(generator.device))  # [M, 1, dim]
    if given:  # a voice bundle's own input embeddings replace the tokens'
        index, values = zip(*given)
        embeddings[list(index), 0] = torch.cat(values).to(embeddings)
    exec_mask = torch.zeros(generator.num_slots, dtype=torch.bool, device=generator.device)
    exec_mask[slot] = True
    generator.lm.set_exec_mask(exec_mask)
    with generator.states.slot(slot):
        for chunk in embeddings.transpose(0, 1).split(PREFILL_CHUNK, dim=1):
            generator.lm.transformer(chunk)
    return embeddings
