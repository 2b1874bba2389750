"""The token grid's prefill at once (`play_forced`) against its steps one by one (`read`, `write`)."""

from __future__ import annotations

import pytest
import torch

from personaplex_triton.core import loaders
from personaplex_triton.lm.token_grid import TokenGrid

DELAYS = loaders.PERSONAPLEX_LM_KWARGS["delays"]
K = len(DELAYS)


def random_grid(gen: torch.Generator, offset: int, provided: float) -> TokenGrid:
    """A one-row grid at `offset` with whatever earlier steps may have left: random tokens, and
    `provided` flags set at random with this probability."""
    grid = TokenGrid(1, DELAYS, torch.arange(100, 100 + K), ungenerated=-2, device="cpu")
    grid.start(0)
    if offset > 1:
        grid.cache[0] = torch.randint(0, 50, grid.cache[0].shape, generator=gen)
        grid.provided[0] = torch.rand(grid.provided[0].shape, generator=gen) < provided
        grid.offset[0] = offset
    return grid


def one_by_one(grid: TokenGrid, forced: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, active, everything = slice(0, 1), torch.ones(1, dtype=torch.bool), torch.ones(1, K, dtype=torch.bool)
    previous, provided = [], []
    for tokens in forced:
        o, before, target, target_provided = grid.read(rows, active, tokens[None], everything)
        grid.write(rows, o, active, target, target_provided)
        previous.append(before[0])
        provided.append(target_provided[0])
    return torch.stack(previous), torch.stack(provided)


@pytest.mark.parametrize("provided", [0.7, 1.0])
@pytest.mark.parametrize("offset", [1, 2, 3, 4, 5, 11])
@pytest.mark.parametrize("steps", [1, 2, 3, 4, 5, 9, 40])
def test_play_forced_equals_the_steps_one_by_one(offset, steps, provided):
    gen = torch.Generator().manual_seed(offset * 100 + steps)
    forced = torch.randint(0, 2048, (steps, K), generator=gen)
    at_once = random_grid(gen, offset, provided)
    by_step = TokenGrid(1, DELAYS, at_once.initial, at_once.ungenerated, "cpu")
    by_step.cache[0], by_step.provided[0], by_step.offset[0] = at_once.cache[0], at_once.provided[0], at_once.offset[0]

    previous, provided = at_once.play_forced(forced)
    want_previous, want_provided = one_by_one(by_step, forced)
    assert torch.equal(previous, want_previous)
    assert torch.equal(provided, want_provided)
    if bool(want_provided.all()):  # else a step samples what was not forced, which a prefill refuses
        assert torch.equal(at_once.cache, by_step.cache)
        assert torch.equal(at_once.provided, by_step.provided)
    assert int(at_once.offset[0]) == int(by_step.offset[0]) == offset + steps
