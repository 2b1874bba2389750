"""Streaming Mimi for a pool of conversation slots: one batched call per tick.

Each slot is a batch row of one Mimi in streaming mode; moshi's exec mask leaves the rows
without a frame this tick untouched, and a reset mask restarts a row for a new conversation.
"""

from __future__ import annotations

import numpy as np
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

    def _batch(self, items: dict, shape: tuple, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-slot arrays -> one [S, *shape] batch on the device and the mask of its rows."""
        batch = torch.zeros((self.num_slots, *shape), dtype=dtype)
        active = torch.zeros(self.num_slots, dtype=torch.bool)
        for slot, value in items.items():
            batch[slot] = torch.as_tensor(np.asarray(value), dtype=dtype)
            active[slot] = True
        return batch.to(self.device), active.to(self.device)

    @torch.no_grad()
    def encode(self, frames: dict[int, np.ndarray]) -> dict[int, torch.Tensor]:
        """A [1920] frame per slot -> its codes [8] (int64, on the CPU), in one batched call."""
        if not frames:
            return {}
        pcm, active = self._batch(frames, (FRAME_SAMPLES,), torch.float32)
        self.mimi.set_exec_mask(active)
        codes = self.mimi.encode(pcm.view(self.num_slots, 1, FRAME_SAMPLES))[:, :, 0].cpu()
        return {slot: codes[slot] for slot in frames}

    @torch.no_grad()
    def decode(self, codes: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Codes [8] per slot -> its 1920 PCM samples (float32), in one batched call."""
        if not codes:
            return {}
        batch, active = self._batch(codes, (NUM_AGENT_CODEBOOKS,), torch.long)
        self.mimi.set_exec_mask(active)
        pcm = self.mimi.decode(batch.view(self.num_slots, NUM_AGENT_CODEBOOKS, 1))[:, 0, :]
        pcm = pcm.float().cpu().numpy()
        return {slot: pcm[slot].copy() for slot in codes}
