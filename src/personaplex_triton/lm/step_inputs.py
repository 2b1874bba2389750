"""What one step of the slot generator forces, and where: the input of its batched step (and
of the idle steps that capture its CUDA graphs). A persona's prefill forces every stream and
takes its tokens whole (prefill.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .token_grid import NUM_AUDIO


@dataclass
class StepInputs:
    """What is forced at one step, row by row: [b] masks, [b, 8] codes, [b] text tokens. Row i
    carries slot `rows[i]` (distinct slots; None: slot i). Under CUDA graphs b is a batch
    bucket, its rows past the carried frames inactive, on slots no other row carries."""

    active: torch.Tensor
    user_codes: torch.Tensor
    agent_codes: torch.Tensor
    agent_forced: torch.Tensor
    text_token: torch.Tensor
    text_forced: torch.Tensor
    embeddings: torch.Tensor | None = None  # [S, 1, dim], replaces the token embeddings where embed_rows
    embed_rows: torch.Tensor | None = None
    user_later: bool = False  # the user's codes come after the step, through `force_user`
    rows: torch.Tensor | None = None  # [b] the slot table


def forced_tokens(inputs: StepInputs, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's forced tokens [b, K] in the grid's stream order, and where they are forced."""
    b = inputs.active.shape[0]
    forced = torch.cat([inputs.text_token.view(b, 1), inputs.agent_codes, inputs.user_codes], dim=1).to(device)
    user_forced = torch.full((b, NUM_AUDIO), not inputs.user_later, dtype=torch.bool, device=inputs.active.device)
    is_forced = torch.cat([inputs.text_forced.view(b, 1), inputs.agent_forced.view(b, 1).expand(b, NUM_AUDIO),
                           user_forced], dim=1)
    return forced, is_forced.to(device)
