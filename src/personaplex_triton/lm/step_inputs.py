"""What one step of the slot generator forces, and where: the input of its batched step (and
of the idle steps that capture its CUDA graphs). A persona's prefill forces every stream and
takes its tokens whole (prefill.py).

A step reaches the device as one int64 tensor, [b, COLUMNS] (`pack`, or `tick_inputs` for a
served tick, built in numpy), which the step unpacks on the device (`unpack`): one copy, where
a tensor per input was a dozen PyTorch calls, each of which lets a Triton stub's other threads
take the GIL from the tick.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .token_grid import NUM_AUDIO

STREAMS = 1 + 2 * NUM_AUDIO  # the grid's order: text, the agent's 8 codebooks, the user's 8
SLOT, ACTIVE, EMBED = 0, 1, 2  # the packed columns: row i's slot, whether it steps, embeds
FORCED = slice(3, 3 + STREAMS)  # the tokens forced at the step's position
IS_FORCED = slice(3 + STREAMS, 3 + 2 * STREAMS)  # where they are forced
COLUMNS = 3 + 2 * STREAMS
HAS_OUTPUT, POSITION = STREAMS, STREAMS + 1  # a step's output columns after its tokens (run_step)
USER = slice(1 + NUM_AUDIO, STREAMS)  # the user's codebooks among the streams


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

    def pack(self) -> torch.Tensor:
        """These inputs as one [b, COLUMNS] int64 tensor on the CPU."""
        b = self.active.shape[0]
        packed = torch.zeros(b, COLUMNS, dtype=torch.long)
        packed[:, SLOT] = torch.arange(b) if self.rows is None else self.rows.cpu()
        packed[:, ACTIVE] = self.active.cpu()
        if self.embed_rows is not None:
            packed[:, EMBED] = self.embed_rows.cpu()
        packed[:, FORCED] = torch.cat([self.text_token.view(b, 1), self.agent_codes, self.user_codes], dim=1).cpu()
        packed[:, IS_FORCED] = torch.cat([self.text_forced.view(b, 1), self.agent_forced.view(b, 1).expand(b, NUM_AUDIO),
                                          torch.full((b, NUM_AUDIO), not self.user_later, device=self.active.device)],
                                         dim=1).cpu()
        return packed



def tick_inputs(table: np.ndarray, carried: int, user_codes: np.ndarray | None = None) -> np.ndarray:
    """A served tick's packed inputs: rows on the slots of `table`, the first `carried` of them
    stepping, forcing the user's codes [carried, 8] (None: nothing forced; they come later,
    through `force_user`)."""
    packed = np.zeros((len(table), COLUMNS), dtype=np.int64)
    packed[:, SLOT] = table
    packed[:carried, ACTIVE] = 1
    if user_codes is not None:
        packed[:carried, FORCED][:, USER] = user_codes
        packed[:, IS_FORCED][:, USER] = 1
    return packed


def unpack(packed: torch.Tensor):
    """(rows [b], active [b], embed_rows [b], forced tokens [b, STREAMS], where forced [b, STREAMS])
    of packed inputs: tensor ops, inside a step's CUDA graph."""
    return (packed[:, SLOT], packed[:, ACTIVE].bool(), packed[:, EMBED].bool(), packed[:, FORCED],
            packed[:, IS_FORCED].bool())
