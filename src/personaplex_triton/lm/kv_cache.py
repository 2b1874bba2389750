"""The temporal transformer's KV cache: its storage dtype, and how moshi's attention reads it.

moshi keeps each self-attention layer's keys and values in a `RingKVCache` of the model's dtype:
at the 7B's 3000-frame context about 1.5 GB a conversation in bf16, which bounds how many
conversations fit and is what a step reads. `kv_dtype` float8_e4m3fn stores them in half the
bytes; the ring attention kernel loads fp8 and upcasts, and moshi's attention (the prefill's
chunks, any step without the kernel) gets the ring upcast (`CastRingKVCache`). On a CPU moshi's
attention reads a ring only up to its last entry written (`FilledRingKVCache`).
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn
from moshi.modules.transformer import KVCacheResult, RingKVCache, _MHAState

KV_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
# Integer views of a cache's bytes: PyTorch's scatter and index kernels do not all take float8.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def resolve(configured: str, device: str, model_dtype: torch.dtype) -> torch.dtype:
    """The talker's `kv_dtype` parameter: "auto" (or "") is the model's dtype; float8_e4m3fn only
    on CUDA, where the ring attention kernel reads it (elsewhere moshi's attention would upcast
    every conversation's whole ring each step: slower, for memory a CPU pool does not lack)."""
    if configured in ("", "auto"):
        return model_dtype
    if configured not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be auto, {' or '.join(KV_DTYPES)}; got {configured!r}")
    dtype = KV_DTYPES[configured]
    if dtype == torch.float8_e4m3fn and torch.device(device).type != "cuda":
        raise ValueError(f"kv_dtype float8_e4m3fn needs a CUDA GPU (the ring attention kernel reads it); "
                         f"this instance runs on {device}")
    return dtype


def store(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as a KV cache of `dtype` holds it. float8_e4m3fn has no infinity, and whether a cast
    past its ±448 saturates or gives NaN has differed between PyTorch versions and kernels; one
    NaN key or value makes every later attention output of its conversation NaN, until the ring
    overwrites it. Clamped first, an outlier saturates instead."""
    if x.dtype == dtype:
        return x
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-FP8_MAX, FP8_MAX)
    return x.to(dtype)


def self_attentions(transformer):
    """The streaming self-attention modules whose ring KV cache this is about (moshi's
    depformer keeps per-step weights and its own small cache)."""
    return [layer.self_attn for layer in transformer.layers
            if not layer.self_attn.cross_attention and not layer.self_attn.weights_per_step]


def bytes_per_conversation(transformer, dtype: torch.dtype) -> int:
    """One conversation's KV cache over every layer at the full context."""
    return sum(2 * (a.num_heads // a.kv_repeat) * (a.embed_dim // a.num_heads) * a.context * dtype.itemsize
               for a in self_attentions(transformer))


class CastRingKVCache(RingKVCache):
    """moshi's ring KV cache with its entries stored in another dtype than the model's: what
    moshi's attention writes goes through `store`, what it reads comes back upcast."""

    def complete(self, k: torch.Tensor, v: torch.Tensor, exec_mask: torch.Tensor) -> KVCacheResult:
        stored = self.cache
        bits = _BITS[stored.itemsize]
        self.cache = stored.view(bits)  # moshi's complete() scatters, on the raw bytes here
        try:
            keys, values, positions = super().complete(store(k, stored.dtype).view(bits),
                                                       store(v, stored.dtype).view(bits), exec_mask)
        finally:
            self.cache = stored
        return KVCacheResult(keys.view(stored.dtype).to(k.dtype), values.view(stored.dtype).to(k.dtype), positions)


def _init_state(self, batch_size: int, dtype: torch.dtype, model_dtype: torch.dtype) -> _MHAState:
    """moshi's `StreamingMultiheadAttention._init_streaming_state`, its cache in `dtype` from the
    start (a `CastRingKVCache` where that is not the activations' `model_dtype`): moshi's own
    allocates the whole pool's cache in its projection weight's dtype first (a large pool's
    cache in bf16 does not fit in one GPU's memory), and with fp8 weights (fp8_weights.py) takes that
    weight's dtype for the activations'."""
    weight = self.in_projs[0].weight
    ring = RingKVCache if dtype == model_dtype else CastRingKVCache
    cache = ring(batch_size, self.num_heads // self.kv_repeat, self.embed_dim // self.num_heads,
                 self.context or self.weights_per_step, respect_exec_mask=not self.weights_per_step,
                 device=weight.device, dtype=dtype)
    return _MHAState(batch_size, weight.device, cache,
                     offset=torch.zeros(batch_size, device=weight.device, dtype=torch.long), offset_cpu=0)


def state_initializer(dtype: torch.dtype, model_dtype: torch.dtype | None = None):
    """An attention's `_init_streaming_state` (to bind to it) whose KV cache holds `dtype`, for
    activations of `model_dtype` (None: `dtype`)."""
    return functools.partial(_init_state, dtype=dtype, model_dtype=model_dtype or dtype)


class FilledRingKVCache(RingKVCache):
    """moshi's ring KV cache, read up to the last entry any row has written: moshi's attention
    then takes its mask and softmax over the entries the conversations have, where it read the
    whole context (3000 frames of keys and values a step, on a CPU a good part of the tick),
    whose unwritten entries its mask drops anyway. The
    bound is read on the host, so it is for the CPU, not for a CUDA graph."""

    def complete(self, k: torch.Tensor, v: torch.Tensor, exec_mask: torch.Tensor) -> KVCacheResult:
        keys, values, positions = super().complete(k, v, exec_mask)
        filled = min(int(self.end_offset.max()), self.capacity)  # past it, every row's entries are unwritten
        return KVCacheResult(keys[:, :, :filled], values[:, :, :filled], positions[:, :filled])


def read_filled(transformer) -> None:
    """The streaming `transformer`'s moshi ring caches read only their filled entries
    (FilledRingKVCache), for moshi's attention on a CPU."""
    for attention in self_attentions(transformer):
        if type(attention._streaming_state.kv_cache) is RingKVCache:
            attention._streaming_state.kv_cache.__class__ = FilledRingKVCache


def store_in(transformer, dtype: torch.dtype, model_dtype: torch.dtype | None = None) -> None:
    """The KV caches of `transformer`'s next `streaming()` hold `dtype`, for activations of
    `model_dtype` (None: the projections' weights', plain linear layers'). Plain linear layers
    and a cache of the activations' dtype: moshi's own state."""
    for attention in self_attentions(transformer):
        activations = model_dtype or attention.in_projs[0].weight.dtype
        if type(attention.in_projs[0]) is nn.Linear and dtype == activations:
            attention.__dict__.pop("_init_streaming_state", None)
        else:
            attention._init_streaming_state = types.MethodType(state_initializer(dtype, activations), attention)
