"""Copies from the host to a GPU that do not wait for the GPU.

A copy from pageable host memory to a CUDA device first waits for all the work queued on its
stream, and the host with it (the driver stages it): between ticks, that is the last tick's Mimi
encode, time-sliced with whatever another process (code2wav's) runs on the GPU. From pinned
memory the copy is queued like a kernel and the host goes on; PyTorch's pinned-memory allocator
keeps the block until the copy is done. Off CUDA these are plain copies.
"""

from __future__ import annotations

import torch


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """`x` on `device`; from the host to a GPU through pinned memory, queued on the stream."""
    device = torch.device(device)
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def copy_into(buffer: torch.Tensor, x: torch.Tensor) -> None:
    """`buffer.copy_(x)`; from the host into a GPU's `buffer` through pinned memory, queued on
    the stream."""
    if buffer.device.type == "cuda" and x.device.type == "cpu":
        buffer.copy_(x.pin_memory(), non_blocking=True)
    else:
        buffer.copy_(x)
