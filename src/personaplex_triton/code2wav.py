"""Stage 1: streaming Mimi decoding for a pool of conversations, batched per tick."""

from __future__ import annotations

import numpy as np
import torch

from .mimi_stream import MimiSlots
from .seam import NUM_AGENT_CODEBOOKS


class Code2Wav:
    """A `Stage` of the slot engine: agent codes [8] in, 1920 PCM samples out, per slot."""

    def __init__(self, mimi, num_slots: int):
        self.num_slots = num_slots
        self.mimi = MimiSlots(mimi, num_slots)

    def start(self, slot: int, setup=None) -> None:
        self.mimi.reset([slot])

    def stop(self, slot: int) -> None:
        pass  # the next start resets the row

    def prefilling(self, slot: int) -> bool:
        return False

    def tick(self, items: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        if not items:
            return {}
        codes = torch.zeros(self.num_slots, NUM_AGENT_CODEBOOKS, dtype=torch.long)
        active = torch.zeros(self.num_slots, dtype=torch.bool)
        for slot, frame_codes in items.items():
            codes[slot] = torch.from_numpy(np.asarray(frame_codes, dtype=np.int64))
            active[slot] = True
        device = self.mimi.device
        pcm = self.mimi.decode(codes.to(device), active.to(device)).float().cpu().numpy()
        return {slot: pcm[slot].copy() for slot in items}
