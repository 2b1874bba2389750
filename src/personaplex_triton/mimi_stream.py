"""Streaming Mimi for a pool of conversation slots: one batched call per tick.

Each slot is a batch row of one Mimi in streaming mode; moshi's exec mask leaves the rows
without a frame this tick untouched, and a reset mask restarts a row for a new conversation.
"""

from __future__ import annotations

import torch

from .contract import FRAME_SAMPLES
from .seam import NUM_AGENT_CODEBOOKS


class MimiSlots:
    def __init__(self, mimi, num_slots: int):
        self.mimi = mimi
        self.num_slots = num_slots
        self.device = next(mimi.parameters()).device
        self._streaming = mimi.streaming(num_slots)
        self._streaming.__enter__()

    def close(self) -> None:
        self._streaming.__exit__(None, None, None)

    def _mask(self, slots) -> torch.Tensor:
        mask = torch.zeros(self.num_slots, dtype=torch.bool, device=self.device)
        mask[list(slots)] = True
        return mask

    def reset(self, slots) -> None:
        """Fresh encoder and decoder state for these slots."""
        self.mimi.reset_streaming(self._mask(slots))

    @torch.no_grad()
    def encode(self, pcm: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """pcm [S, 1920] float -> codes [S, 8] (rows outside `active` hold garbage)."""
        self.mimi.set_exec_mask(active)
        return self.mimi.encode(pcm.view(self.num_slots, 1, FRAME_SAMPLES))[:, :, 0]

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """codes [S, 8] -> pcm [S, 1920] (rows outside `active` hold garbage)."""
        self.mimi.set_exec_mask(active)
        codes = codes.view(self.num_slots, NUM_AGENT_CODEBOOKS, 1)
        return self.mimi.decode(codes)[:, 0, :]
