"""Streaming Mimi for a pool of conversation slots: one batched step per tick.

The pool holds every slot's state tensors ([slots + 1, ...] each, offset first: the last row
is spare, for the rows a padded batch carries); a tick's step, on the runner, gathers the rows
of the slots with a frame, steps them and writes what changed back (rings: only their new
entries). A fresh stream is all zeros, so a reset zeroes a row.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.host_copies import to_device
from .runtime import StepRunner
from .steps import STEPS


class MimiSlots:
    def __init__(self, runner: StepRunner, num_slots: int):
        self.runner = runner
        self.num_slots = num_slots
        self.input = STEPS[runner.stage].input
        self.spare = num_slots
        self.state = [torch.zeros((num_slots + 1, *spec.shape), dtype=spec.dtype, device=runner.device)
                      for spec in runner.state_specs]
        runner.prepare(self.state, self.spare)

    def reset(self, slots) -> None:
        """Fresh state for these slots."""
        rows = to_device(torch.tensor(list(slots), dtype=torch.long), self.state[0].device)  # one copy to the device
        for tensor in self.state:
            tensor.index_fill_(0, rows, 0)

    def _step(self, items: dict[int, np.ndarray]) -> tuple[list[int], torch.Tensor]:
        slots = sorted(items)
        # stacked in numpy: a PyTorch call a row would let other threads take the GIL as often
        x = torch.from_numpy(np.stack([np.asarray(items[s]) for s in slots])).to(self.input.dtype)
        return slots, self.runner.run_rows(x.view(len(slots), *self.input.shape), slots, self.state, self.spare)

    def encode(self, frames: dict[int, np.ndarray]) -> dict[int, torch.Tensor]:
        """A [1920] frame per slot -> its codes [8] (int64, on the CPU), in one batched step."""
        if not frames:
            return {}
        slots, codes = self.encode_rows(frames)
        codes = codes.cpu()
        return {slot: codes[i] for i, slot in enumerate(slots)}

    def encode_rows(self, frames: dict[int, np.ndarray]) -> tuple[list[int], torch.Tensor]:
        """`encode` left where the runner made it: the slots, sorted, and their codes [n, 8]
        (int64, on the runner's device; valid until the pool's next step)."""
        slots, codes = self._step(frames)
        return slots, codes[:, :, 0]

    def decode(self, codes: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Codes [8] per slot -> its 1920 PCM samples (float32), in one batched step."""
        if not codes:
            return {}
        slots, pcm = self._step(codes)
        pcm = pcm[:, 0, :].float().cpu().numpy()
        return {slot: pcm[i].copy() for i, slot in enumerate(slots)}
