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


def test_force_writes_the_user_codes_where_a_step_at_each_position_would_have():
    """`force` (the user's codes after a tick, its index built on the host) writes each slot's
    values at its own position + delay and flags them provided, as `read` forcing them at that
    step does; every other entry, and every other slot, is left as it was."""
    gen = torch.Generator().manual_seed(3)
    user = slice(1 + 8, None)
    slots, positions = [2, 0], [5, 12]
    values = torch.randint(0, 2048, (2, 8), generator=gen)
    forced = TokenGrid(4, DELAYS, torch.arange(100, 100 + K), ungenerated=-2, device="cpu")
    forced.cache[:] = torch.randint(0, 50, forced.cache.shape, generator=gen)
    stepped = TokenGrid(4, DELAYS, torch.arange(100, 100 + K), ungenerated=-2, device="cpu")
    stepped.cache[:], stepped.provided[:] = forced.cache, forced.provided
    forced.force(slots, positions, user, values)
    for slot, o, codes in zip(slots, positions, values):
        tokens = torch.zeros(1, K, dtype=torch.long)
        tokens[0, user] = codes
        where = torch.zeros(1, K, dtype=torch.bool)
        where[0, user] = True
        stepped.offset[slot] = o
        stepped.read(torch.tensor([slot]), torch.ones(1, dtype=torch.bool), tokens, where)
    assert torch.equal(forced.cache, stepped.cache) and torch.equal(forced.provided, stepped.provided)
    assert int(forced.provided.sum()) == len(slots) * 8


def test_a_fresh_row_is_what_a_started_slot_reads_back():
    """`fresh_row` builds on the host the row `start` leaves a slot with (the prefill's grid,
    without reading it back from the device), whatever the slot held before."""
    gen = torch.Generator().manual_seed(3)
    grid = TokenGrid(3, DELAYS, torch.arange(100, 100 + K), ungenerated=-2, device="cpu")
    grid.cache[:] = torch.randint(0, 50, grid.cache.shape, generator=gen)
    grid.provided[:] = torch.rand(grid.provided.shape, generator=gen) < 0.5
    grid.offset[:] = 7
    grid.start(1)
    fresh, started = grid.fresh_row(), grid.row(1)
    for name in ("cache", "provided", "offset", "delays", "initial"):
        assert torch.equal(getattr(fresh, name), getattr(started, name)), name
    assert not torch.equal(fresh.cache[0], grid.cache[0])  # slot 0 was not started
