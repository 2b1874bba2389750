"""Per-conversation token sampling for a batch of conversation slots.

Each row draws its randomness from a counter-based hash of (seed, step, channel, rank), so a
conversation's samples depend only on its own seed and position, never on the other rows of
the batch or on how many draws happened before: no shared generator state, nothing that a
CUDA graph could not capture. Sampling is PersonaPlex's: temperature, top-k, then one draw
from the renormalised distribution (as an exponential race, like moshi's `multinomial`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core import loaders, tunables

_MASK32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def uniform(seed: torch.Tensor, step: torch.Tensor, channels: int, n: int) -> torch.Tensor:
    """[B, channels, n] floats in (0, 1), each a pure function of (seed[b], step[b], channel,
    column): a row's draws do not depend on how many columns or channels are computed."""
    h = _fmix32(seed & _MASK32)
    h = _fmix32(h ^ ((seed >> 32) & _MASK32))
    h = _fmix32(h ^ (step & _MASK32))
    channel = torch.arange(channels, device=seed.device, dtype=torch.long)
    h = _fmix32(h[:, None] ^ channel[None, :])
    col = torch.arange(n, device=seed.device, dtype=torch.long)
    h = _fmix32(h[:, :, None] ^ col[None, None, :])
    return (h.to(torch.float64) + 0.5) / 2.0**32


def exponential_noise(seed: torch.Tensor, step: torch.Tensor, channels: int, n: int) -> torch.Tensor:
    """[B, channels, n] float32 -log(uniform): the exponential race's noise of every channel of
    a step at once, so that each of a step's sampling calls costs no hashing of its own."""
    return -torch.log(uniform(seed, step, channels, n)).float()


@dataclass
class SamplingParams:
    """Sampling settings of one conversation (PersonaPlex's defaults)."""

    seed: int = 0
    greedy: bool = False
    temperature: float = loaders.TEMPERATURE
    temperature_text: float = loaders.TEMPERATURE_TEXT
    top_k: int = loaders.TOP_K
    top_k_text: int = loaders.TOP_K_TEXT

    def validate(self) -> None:
        """ValueError naming the input (as the wire contract calls it) that is out of range."""
        for name, value in (("TEMPERATURE", self.temperature), ("TEMPERATURE_TEXT", self.temperature_text)):
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
            if not self.greedy and not 0 < value <= tunables.MAX_TEMPERATURE:
                raise ValueError(f"{name} must lie in (0, {tunables.MAX_TEMPERATURE:g}], got {value:g} "
                                 "(use GREEDY for argmax)")
        for name, value in (("TOP_K", self.top_k), ("TOP_K_TEXT", self.top_k_text)):
            if not 1 <= value <= tunables.MAX_TOP_K:
                raise ValueError(f"{name} must lie in [1, {tunables.MAX_TOP_K}], got {value}")


class SlotSampling:
    """The sampling settings of every slot, as tensors, for batched sampling."""

    def __init__(self, num_slots: int, device):
        self.seed = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.greedy = torch.zeros(num_slots, dtype=torch.bool, device=device)
        self.temperature = torch.ones(num_slots, device=device)
        self.temperature_text = torch.ones(num_slots, device=device)
        self.top_k = torch.ones(num_slots, dtype=torch.long, device=device)
        self.top_k_text = torch.ones(num_slots, dtype=torch.long, device=device)
        # The same two on the host: the step's graphs are keyed by the largest's bucket, and
        # reading it back from the GPU made every start wait for the GPU.
        self._host_top_k, self._host_top_k_text = [1] * num_slots, [1] * num_slots

    def largest_top_k(self) -> tuple[int, int]:
        """The largest top-k of any slot (audio, text), as the tensors hold them."""
        return max(self._host_top_k), max(self._host_top_k_text)

    def set(self, slot: int, params: SamplingParams) -> None:
        self.seed[slot] = params.seed & ((1 << 63) - 1)
        self.greedy[slot] = params.greedy
        self.temperature[slot] = params.temperature
        self.temperature_text[slot] = params.temperature_text
        self.top_k[slot] = params.top_k
        self.top_k_text[slot] = params.top_k_text
        self._host_top_k[slot], self._host_top_k_text[slot] = params.top_k, params.top_k_text

    def at(self, rows: torch.Tensor) -> "SlotSampling":
        """The settings of slots `rows` [b], row by row (copies)."""
        carried = object.__new__(SlotSampling)
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(carried, name, value[rows])
        return carried


def sample(
    logits: torch.Tensor,
    greedy: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    noise: torch.Tensor,
    max_top_k: int,
) -> torch.Tensor:
    """One token per row of logits [B, V]; every argument but the last is per row. `noise`:
    the row's channel of `exponential_noise`, at least min(max_top_k, V) columns."""
    return Sampler(greedy, temperature, top_k, max_top_k, logits.shape[-1])(logits, noise)


class Sampler:
    """`sample` over logits of `vocab` columns, for calls that share the rows' settings (a
    step's codebooks): what depends on the settings alone is made once."""

    def __init__(self, greedy: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, max_top_k: int,
                 vocab: int):
        self.k = min(max_top_k, vocab)
        self.greedy = greedy
        self.temperature = temperature[:, None]
        self.kept = torch.arange(self.k, device=top_k.device)[None, :] < top_k[:, None]  # ranks within top_k

    def __call__(self, logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        argmax = logits.argmax(dim=-1)
        top_logits, top_index = (logits / self.temperature).topk(self.k, dim=-1)
        probs = torch.where(self.kept, torch.softmax(top_logits, dim=-1), 0.0)
        race = probs / noise[:, :self.k]
        drawn = top_index.gather(-1, race.argmax(dim=-1, keepdim=True))[:, 0]
        return torch.where(self.greedy, argmax, drawn)
