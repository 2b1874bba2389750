"""A decode step's attention over moshi's ring KV cache that reads only the filled entries.

moshi's streaming attention hands SDPA the whole ring (the 7B's 3000-frame context) with a mask
of the entries not yet written, so every step reads every slot's full cache: about 100 GB at 64
conversations, most of a tick. At one frame a step the query attends to every entry written so
far (all of them once the ring has wrapped, as the context equals the ring), in any order, since
RoPE was applied before the keys were stored. So this kernel reads, per conversation, only the
first `min(end_offset, capacity)` entries, split across the ring (flash-decoding) so that one
conversation still spreads over the whole GPU. The shapes are fixed, so it runs under the
step's CUDA graph. The cache may hold float8_e4m3fn (kv_cache.py): the kernel upcasts what it
loads to the query's dtype. Before it, `rope_and_store` applies RoPE and writes the frame's key
and value into the ring in two kernels: moshi's RoPE and ring write are about forty small kernels
a layer, which at one conversation cost more than the layer's attention.

It replaces the forward of the temporal transformer's attention modules for one-frame steps on
CUDA (`install`); every other call, the CPU and the prefill's chunks keep moshi's path, which
tests use as the reference.
"""

from __future__ import annotations

import math
import types

import torch
from einops import rearrange

from .kv_cache import FP8_MAX, self_attentions

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton: moshi's attention runs there
    triton = None

MIN_SPLIT = 256        # ring entries per program, at least
TARGET_PROGRAMS = 1024  # enough programs to keep every SM of a large GPU (over a hundred) reading
BLOCK_N = 64            # entries per load
# An fp8 ring's launch: fp16 dots (e4m3 to fp16 is one packed conversion on Hopper, to bf16 three)
# in a 4-stage pipeline, which made a layer and the 7B tick faster than bf16 dots
# (docs/decisions.md).
FP8_LAUNCH = {"dot_dtype": torch.float16, "stages": 4}


if triton is not None:
    _FP8_MAX = tl.constexpr(FP8_MAX)
    _FP16_MAX = tl.constexpr(65504.0)

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, slot_ptr, mask_ptr, acc_ptr, max_ptr, sum_ptr,
                          stride_qb, stride_qh, stride_kb, stride_kh, stride_kn,
                          num_heads, kv_repeat, num_splits, split_size, capacity, scale,
                          BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
                          INDEXED: tl.constexpr, MASKED: tl.constexpr, FP16_DOT: tl.constexpr):
        """One (conversation, head, split): an unnormalised softmax sum over the split's filled
        entries, with its maximum and sum. The scores come from tensor cores, the query repeated
        to 16 rows (tl.dot's least), so the tiles go through shared memory, pipelined (read as
        vectors into registers they made the kernel slower); the softmax then runs on one row
        of them, not on 16 equal rows, which shortened the fp8 ring's step and left bf16's,
        already at its bandwidth, unchanged."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        b = row // num_heads
        kv_head = (row % num_heads) // kv_repeat
        length = tl.minimum(tl.load(len_ptr + b), capacity)  # a wrapped ring: every entry
        if MASKED:  # a row that does not step reads nothing: its output is never used
            length = tl.where(tl.load(mask_ptr + b) != 0, length, 0)
        start = split * split_size
        end = tl.minimum(start + split_size, length)
        dims = tl.arange(0, HEAD_DIM)
        first_copy = tl.arange(0, 16) == 0
        q = tl.load(q_ptr + b * stride_qb + (row % num_heads) * stride_qh + dims)
        if FP16_DOT:  # the entries, the query and the weights meet in fp16 (`attend`'s dot_dtype)
            q = tl.minimum(tl.maximum(q.to(tl.float32), -_FP16_MAX), _FP16_MAX).to(tl.float16)
        q = tl.broadcast_to(q[None, :], (16, HEAD_DIM))
        slot = tl.load(slot_ptr + b) if INDEXED else b  # the row's ring in the pool (the slot table)
        base = slot * stride_kb + kv_head * stride_kh
        running_max = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        running_sum = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
        acc = tl.zeros([16, HEAD_DIM], tl.float32)  # 16 equal rows, for the tensor cores
        for first in range(start, end, BLOCK):
            entries = first + tl.arange(0, BLOCK)
            valid = entries < end
            offsets = base + entries[:, None] * stride_kn + dims[None, :]
            k = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0).to(q.dtype)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            scores = tl.sum(tl.where(first_copy[:, None], scores, 0.0), axis=0) * scale  # row 0, exactly
            scores = tl.where(valid, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=0))
            weights = tl.exp(scores - new_max)
            rescale = tl.exp(running_max - new_max)
            v = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0).to(q.dtype)
            rows = tl.broadcast_to(weights[None, :], (16, BLOCK)).to(v.dtype)
            acc = acc * rescale + tl.dot(rows, v, input_precision=PRECISION)
            running_sum = running_sum * rescale + tl.sum(weights, axis=0)
            running_max = new_max
        out = row * num_splits + split
        tl.store(acc_ptr + out * HEAD_DIM + dims, tl.sum(tl.where(first_copy[:, None], acc, 0.0), axis=0))
        tl.store(max_ptr + out, running_max)
        tl.store(sum_ptr + out, running_sum)

    @triton.jit
    def _merge_kernel(acc_ptr, max_ptr, sum_ptr, out_ptr, num_splits,
                      SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
        """Each split holds an unnormalised sum under its own running maximum: rescale them to
        the largest and normalise. A row with no entries gets zeros."""
        row = tl.program_id(0)
        splits = tl.arange(0, SPLITS)
        dims = tl.arange(0, HEAD_DIM)
        present = splits < num_splits
        maxima = tl.load(max_ptr + row * num_splits + splits, mask=present, other=float("-inf"))
        sums = tl.load(sum_ptr + row * num_splits + splits, mask=present, other=0.0)
        top = tl.max(maxima, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)
        scale = tl.exp(maxima - top)
        acc = tl.load(acc_ptr + (row * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :],
                      mask=present[:, None], other=0.0)
        total = tl.maximum(tl.sum(sums * scale, axis=0), 1e-30)
        out = tl.sum(acc * scale[:, None], axis=0) / total
        tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _store_entry(dst, value, FP8: tl.constexpr):
        """A key or value (the model's dtype) into the ring's dtype, saturated first for fp8
        as kv_cache.store does: float8_e4m3fn has no infinity."""
        if FP8:
            value = tl.minimum(tl.maximum(value.to(tl.float32), -_FP8_MAX), _FP8_MAX)
        tl.store(dst, value.to(dst.dtype.element_ty))

    @triton.jit
    def _rope_store_kernel(proj_ptr, q_ptr, cache_ptr, slot_ptr, offset_ptr, end_ptr, mask_ptr,
                           stride_pb, stride_ckv, stride_cb, stride_ch, stride_cn,
                           num_heads, kv_heads, capacity, freq_scale,
                           HALF: tl.constexpr, ROPE: tl.constexpr, FP8: tl.constexpr, INDEXED: tl.constexpr):
        """One (conversation, head) of a frame's projections [q heads | k heads | v heads]:
        RoPE at the row's offset on the query head and on the key head of the same index
        (interleaved pairs, in fp32, as moshi's apply_rope), the query out, the key and value
        into ring entry end % capacity if the row steps. The offsets move on after
        (`_advance_kernel`): every head of the row reads them first."""
        b = tl.program_id(0)
        head = tl.program_id(1)
        pairs = 2 * tl.arange(0, HALF)
        D = 2 * HALF
        offset = tl.load(offset_ptr + b)
        dtype = q_ptr.dtype.element_ty
        angle = tl.exp((pairs // 2).to(tl.float32) * freq_scale) * offset.to(tl.float32)
        cos, sin = tl.cos(angle), tl.sin(angle)
        row = proj_ptr + b * stride_pb

        real = tl.load(row + head * D + pairs).to(tl.float32)
        imag = tl.load(row + head * D + pairs + 1).to(tl.float32)
        if ROPE:
            real, imag = real * cos - imag * sin, real * sin + imag * cos
        q_out = q_ptr + (b * num_heads + head) * D + pairs
        tl.store(q_out, real.to(dtype))
        tl.store(q_out + 1, imag.to(dtype))

        if (head < kv_heads) & (tl.load(mask_ptr + b) != 0):
            k_in = row + (num_heads + head) * D + pairs
            v_in = k_in + kv_heads * D
            real = tl.load(k_in).to(tl.float32)
            imag = tl.load(k_in + 1).to(tl.float32)
            if ROPE:
                real, imag = real * cos - imag * sin, real * sin + imag * cos
            slot = tl.load(slot_ptr + b) if INDEXED else b
            entry = cache_ptr + slot * stride_cb + head * stride_ch + (tl.load(end_ptr + b) % capacity) * stride_cn + pairs
            _store_entry(entry, real.to(dtype), FP8)
            _store_entry(entry + 1, imag.to(dtype), FP8)
            _store_entry(entry + stride_ckv, tl.load(v_in), FP8)
            _store_entry(entry + stride_ckv + 1, tl.load(v_in + 1), FP8)

    @triton.jit
    def _advance_kernel(offset_ptr, end_ptr, mask_ptr, rows, BLOCK: tl.constexpr):
        """The offsets of the rows that stepped move on one, as moshi's attention and
        `complete()` move them."""
        b = tl.arange(0, BLOCK)
        inside = b < rows
        steps = tl.load(mask_ptr + b, mask=inside, other=0).to(tl.int64)
        tl.store(offset_ptr + b, tl.load(offset_ptr + b, mask=inside) + steps, mask=inside)
        tl.store(end_ptr + b, tl.load(end_ptr + b, mask=inside) + steps, mask=inside)

def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def num_splits(rows: int, capacity: int) -> int:
    """How many programs share one (conversation, head)'s ring: few rows (one conversation has
    32 heads) need splits to fill the GPU; many rows read best whole, one program each."""
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, rows), triton.cdiv(capacity, MIN_SPLIT)))


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
           rows: torch.Tensor | None = None, active: torch.Tensor | None = None, splits: int | None = None,
           block: int = BLOCK_N, warps: int = 4, stages: int | None = None,
           dot_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Softmax attention of q [B, H, 1, D] over entries [0, min(lengths[b], capacity)) of the
    keys and values [P, H / kv_repeat, capacity, D] of pool row `rows[b]` (None: row b) (each
    with a unit stride on D and a common layout; q's dtype or float8_e4m3fn); returns
    [B, H, 1, D] in q's dtype. A row with no entries gets zeros, and so does a row that
    `active` [B] (bool; None: all) leaves out: it reads no entries (a graphed step's batch is
    padded to its bucket with rows that do not step, whose whole contexts it would read).
    `splits`, `block`, `warps`, `stages` (loads in flight, Triton's `num_stages`; None: its
    default): the launch (default: `num_splits`), for the benchmark.
    `dot_dtype`: what the tensor cores multiply, q's dtype (None) or torch.float16 (the query
    clamped to fp16's range): for an fp8 ring on Hopper, e4m3 to fp16 is one packed conversion
    per two entries and e4m3 to bf16 three (Triton's lowering), and fp16 holds every e4m3 value
    and every bf16 query of fp16's range exactly."""
    B, H, _, D = q.shape
    capacity = keys.shape[2]
    splits = splits or num_splits(B * H, capacity)
    split_size = triton.cdiv(capacity, splits)
    if keys.stride() != values.stride() or keys.stride(3) != 1 or q.stride(3) != 1:
        raise ValueError("keys and values need one layout with contiguous heads")
    acc = torch.empty((B * H, splits, D), device=q.device, dtype=torch.float32)
    maxima = torch.empty((B * H, splits), device=q.device, dtype=torch.float32)
    sums = torch.empty_like(maxima)
    args = (q, keys, values, lengths, lengths if rows is None else rows, lengths if active is None else active,
            acc, maxima, sums,
            q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
            H, H // keys.shape[1], splits, split_size, capacity, D ** -0.5)
    if dot_dtype not in (None, q.dtype, torch.float16):
        raise ValueError(f"dot_dtype is the query's dtype or torch.float16, got {dot_dtype}")
    fp16_dot = dot_dtype == torch.float16 and q.dtype != torch.float16
    precision = "ieee" if q.dtype == torch.float32 and not fp16_dot else "tf32"  # fp32 models: no TF32 rounding
    pipeline = {} if stages is None else {"num_stages": stages}
    _split_kernel[(B * H, splits)](*args, BLOCK=block, HEAD_DIM=D, PRECISION=precision, INDEXED=rows is not None,
                                   MASKED=active is not None, FP16_DOT=fp16_dot, num_warps=warps, **pipeline)
    out = torch.empty((B, H, 1, D), device=q.device, dtype=q.dtype)
    _merge_kernel[(B * H,)](acc, maxima, sums, out, splits,
                            SPLITS=triton.next_power_of_2(splits), HEAD_DIM=D)
    return out


def rope_and_store(projected: torch.Tensor, offset: torch.Tensor, cache, exec_mask: torch.Tensor,
                   num_heads: int, rope_period: float | None) -> torch.Tensor:
    """One frame's projections [B, 1, (H + 2 * kv heads) * D] -> the query [B, H, 1, D], RoPE'd
    at each row's `offset` (moshi's interleaved pairs; None: no RoPE). Each row stepped
    (`exec_mask`) writes its RoPE'd key and its value into ring entry `end_offset % capacity` of
    `cache` (moshi's RingKVCache), and its `offset` and the cache's `end_offset` move on one,
    as moshi's `complete()` and attention do. Rows not stepped keep their entries, where moshi
    writes their frame too: once their ring has wrapped, that replaces the oldest entry an idle
    conversation still attends to. Two kernels, where moshi's RoPE and write are about forty.
    A cache with a slot table (`cache.rows`, slot_states.CarriedRows) holds the pool's rings:
    row b's entry goes into ring `rows[b]`."""
    B = projected.shape[0]
    store = cache.cache  # [2, pool rows, kv heads, capacity, D]
    rows = getattr(cache, "rows", None)
    kv_heads, D = store.shape[2], store.shape[4]
    if projected.stride(2) != 1 or store.stride(4) != 1 or D % 2:
        raise ValueError("projections and the ring need contiguous heads of an even size")
    q = torch.empty((B, num_heads, 1, D), device=projected.device, dtype=projected.dtype)
    _rope_store_kernel[(B, num_heads)](projected, q, store, offset if rows is None else rows, offset,
                                       cache.end_offset, exec_mask,
                                       projected.stride(0), store.stride(0), store.stride(1), store.stride(2),
                                       store.stride(3), num_heads, kv_heads, cache.capacity,
                                       -math.log(rope_period or 1.0) * 2 / D,
                                       HALF=D // 2, ROPE=rope_period is not None,
                                       FP8=store.dtype == torch.float8_e4m3fn, INDEXED=rows is not None)
    _advance_kernel[(1,)](offset, cache.end_offset, exec_mask, B, BLOCK=triton.next_power_of_2(B))
    return q


def _decode_forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """One frame of a streaming self-attention module: moshi's projection, `rope_and_store`,
    `attend` over the filled entries, moshi's output projection. Anything else goes to moshi's
    forward."""
    state = self._streaming_state
    if (state is None or query.shape[1] != 1 or state.kv_cache is None or len(self.in_projs) != 1
            or (self.rope is not None and not self.rope.interleave)):
        return type(self).forward(self, query, key, value)
    cache = state.kv_cache
    q = rope_and_store(self.in_projs[0](query), state.offset, cache, state.exec_mask, self.num_heads,
                       self.rope.max_period if self.rope is not None else None)
    fp8 = cache.cache.dtype == torch.float8_e4m3fn
    x = attend(q, cache.cache[0], cache.cache[1], cache.end_offset, getattr(cache, "rows", None), state.exec_mask,
               **(FP8_LAUNCH if fp8 else {}))
    state.offset_cpu += 1
    return self.out_projs[0](rearrange(x, "b h t d -> b t (h d)"))


def install(transformer) -> int:
    """Route the one-frame steps of `transformer`'s self-attention layers through `attend`;
    returns how many layers. Only where `available`."""
    layers = self_attentions(transformer)
    for attention in layers:
        attention.forward = types.MethodType(_decode_forward, attention)
    return len(layers)


def uninstall(transformer) -> None:
    """Back to moshi's attention (the reference)."""
    for attention in self_attentions(transformer):
        attention.__dict__.pop("forward", None)
