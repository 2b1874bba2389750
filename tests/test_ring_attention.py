"""The ring attention (ring_attention.py) on the CPU, through OpenAI Triton's interpreter, against
moshi's attention in fp32 (the reference): the kernel over bf16-, fp32- and fp8-stored rings,
and the one-frame decode (the frame written directly, no `complete()`) across the ring's wrap.
tests/test_gpu.py runs the same on CUDA.

    TRITON_INTERPRET=1 PYTHONPATH=/path/to/triton:src .venv/bin/python -m pytest tests/test_ring_attention.py
"""

import os

import pytest
import torch
from conftest import greedy_tokens_of, tiny_moshi_lm

from personaplex_triton.lm import fused_ops, kv_cache, ring_attention
from personaplex_triton.lm.generation import SlotGenerator
from personaplex_triton.lm.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    ring_attention.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs OpenAI Triton with TRITON_INTERPRET=1 (its interpreter runs the kernels on the CPU)")

FP8 = torch.float8_e4m3fn
FP8_LARGEST = 448.0  # e4m3's largest finite value


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16, FP8])
def test_kernel_over_stored_ring(stored):
    """fp32 queries over a ring stored in `stored`: softmax attention over the stored values
    upcast (to fp32 rounding), and within fp8's error of the unrounded values. Rows with no
    entry, some, and all."""
    torch.manual_seed(0)
    B, H, C, D = 3, 2, 40, 64
    exact = torch.randn(2, B, H, C, D)
    cache = kv_cache.store(exact, stored)
    q = torch.randn(B, H, 1, D)
    lengths = torch.tensor([0, 7, C])
    out = ring_attention.attend(q, cache[0], cache[1], lengths, splits=2, block=16)
    assert out.dtype == torch.float32 and torch.count_nonzero(out[0]) == 0
    for b in (1, 2):
        n = int(lengths[b])

        def softmax_attention(kv):
            return torch.softmax(q[b] @ kv[0, b, :, :n].transpose(-1, -2) / D ** 0.5, dim=-1) @ kv[1, b, :, :n]
        torch.testing.assert_close(out[b], softmax_attention(cache.float()), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[b], softmax_attention(exact), atol=0.1, rtol=0.1)


def test_rows_that_do_not_step_read_nothing():
    """`active`: a row left out gets zeros, however full its ring (a graphed step's padding rows
    are other conversations' slots); the rows that step get what they get without the mask."""
    torch.manual_seed(0)
    B, H, C, D = 3, 2, 40, 64
    cache = torch.randn(2, B, H, C, D)
    q = torch.randn(B, H, 1, D)
    lengths = torch.tensor([C, C, 9])
    whole = ring_attention.attend(q, cache[0], cache[1], lengths, splits=2, block=16)
    masked = ring_attention.attend(q, cache[0], cache[1], lengths, active=torch.tensor([True, False, True]),
                                   splits=2, block=16)
    assert torch.count_nonzero(whole[1]) > 0 and torch.count_nonzero(masked[1]) == 0
    torch.testing.assert_close(masked[[0, 2]], whole[[0, 2]], atol=0, rtol=0)



@pytest.mark.parametrize("query", [torch.float32, torch.bfloat16])
def test_fp16_dot_over_fp8_ring(query):
    """`dot_dtype=float16` over an fp8 ring: the entries go to the tensor cores exactly (fp16
    holds every e4m3 value), the query and the softmax weights rounded to fp16, so the result is
    the attention of the fp16-rounded query within fp16's rounding of the weights, and at least
    as close to the fp32 attention as the default (query-dtype) dot. A query beyond fp16's range
    is clamped to it, never turned into inf or NaN."""
    torch.manual_seed(0)
    B, H, C, D = 2, 2, 40, 64
    cache = kv_cache.store(torch.randn(2, B, H, C, D), FP8)
    q = torch.randn(B, H, 1, D).to(query)
    lengths = torch.tensor([17, C])
    fp16 = ring_attention.attend(q, cache[0], cache[1], lengths, splits=2, block=16, dot_dtype=torch.float16)
    default = ring_attention.attend(q, cache[0], cache[1], lengths, splits=2, block=16)
    assert fp16.dtype == query
    for b in range(B):
        n = int(lengths[b])
        keys, values = cache[0, b, :, :n].float(), cache[1, b, :, :n].float()

        def attention(queries):
            return torch.softmax(queries @ keys.transpose(-1, -2) / D ** 0.5, dim=-1) @ values
        torch.testing.assert_close(fp16[b].float(), attention(q[b].half().float()), atol=4e-3, rtol=4e-3)
        exact = attention(q[b].float())
        assert (fp16[b].float() - exact).abs().max() <= (default[b].float() - exact).abs().max() + 1e-3
    # Two entries whose scores differ only by the query's fp16 rounding (1 + 2**-11 is 1 in fp16):
    # the default dot tells them apart, the fp16 one weighs them equally (values +1 and -1).
    kv = torch.zeros(2, 1, 1, 2, D)  # (keys, values), one row, one head, two entries
    kv[0, 0, 0, 0, 0] = kv[0, 0, 0, 1, 1] = FP8_LARGEST
    kv[1, 0, 0, 0, 0], kv[1, 0, 0, 1, 0] = 1.0, -1.0
    ring = kv_cache.store(kv, FP8)
    tied = torch.zeros(1, 1, 1, D, dtype=torch.float32)
    tied[0, 0, 0, :2] = torch.tensor([1 + 2.0 ** -11, 1.0])
    apart = ring_attention.attend(tied, ring[0], ring[1], torch.tensor([2]), block=16)
    even = ring_attention.attend(tied, ring[0], ring[1], torch.tensor([2]), block=16, dot_dtype=torch.float16)
    assert float(apart[0, 0, 0, 0]) > 0.01 and float(even[0, 0, 0, 0]) == 0.0
    huge = q.clone()
    huge[0, 0, 0, 0] = 1e6 if query == torch.float32 else 2.0 ** 100
    out = ring_attention.attend(huge, cache[0], cache[1], lengths, splits=2, block=16, dot_dtype=torch.float16)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="dot_dtype"):
        ring_attention.attend(q, cache[0], cache[1], lengths, dot_dtype=torch.float64)

def stepped(lm, ring: bool, stored, steps=16, batch=3):
    """The temporal transformer's outputs over `steps` frames (a 12-entry ring: it wraps),
    row 2 idle before the wrap, and the caches at the end."""
    kv_cache.store_in(lm.transformer, stored)
    if ring:
        ring_attention.install(lm.transformer)
    torch.manual_seed(1)
    outputs = []
    try:
        with lm.transformer.streaming(batch):
            for step in range(steps):
                stepping = torch.tensor([True, True, step % 2 == 0 or step > 10])
                lm.transformer.set_exec_mask(stepping)
                outputs.append(lm.transformer(torch.randn(batch, 1, lm.dim))[stepping])  # an idle row's is unused
            caches = [(m._streaming_state.kv_cache.cache.clone(), m._streaming_state.kv_cache.end_offset.clone())
                      for m in kv_cache.self_attentions(lm.transformer)]
    finally:
        ring_attention.uninstall(lm.transformer)
        kv_cache.store_in(lm.transformer, torch.float32)
    return outputs, caches


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return tiny_moshi_lm("cpu", torch.float32, context=12)


def test_decode_equals_moshi_across_the_wrap(lm):
    """fp32: each frame's output of the rows that step and, at the end, every cache and
    end_offset equal moshi's, to fp32 rounding (the kernels' RoPE and sums round in another
    order than moshi's ops; an idle row's output, which moshi computes and nothing uses, the
    ring kernel leaves at zero attention). Row 2
    idles only before its ring wraps: past it, moshi's write of an idle row replaces an entry it
    attends to, which the ring path does not (conftest.rope_and_store_against_moshi)."""
    ring, moshi = stepped(lm, True, torch.float32), stepped(lm, False, torch.float32)
    for got, want in zip(ring[0], moshi[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for (cache, end), (want_cache, want_end) in zip(ring[1], moshi[1]):
        assert end.tolist() == want_end.tolist() == [16, 16, 11]
        torch.testing.assert_close(cache, want_cache, atol=1e-5, rtol=1e-5)


@pytest.mark.skip(reason="Triton's interpreter mis-rounds float8_e4m3fn stores (7.8 gives 4); tests/test_gpu.py "
                  "runs the fp8 decode (test_fp8_kv_close_to_bf16) and write (test_rope_and_store_on_gpu) on CUDA")
def test_fp8_decode_equals_moshis_on_the_fp8_ring(lm):
    """The kernel over the fp8 ring gives what moshi's attention gives over the same ring upcast
    (up to a second-layer entry rounded to the next fp8 value: the two attentions' fp32 sums
    differ in their last bits), and stays near the fp32 cache's outputs."""
    ring, moshi = stepped(lm, True, FP8), stepped(lm, False, FP8)
    reference, _ = stepped(lm, False, torch.float32)
    for got, want, exact in zip(ring[0], moshi[0], reference):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
        assert torch.linalg.norm(got - exact) <= 0.05 * torch.linalg.norm(exact)
    for (cache, end), (want_cache, want_end) in zip(ring[1], moshi[1]):
        assert cache.dtype == FP8 and torch.equal(end, want_end)
        torch.testing.assert_close(cache.float(), want_cache.float(), atol=0, rtol=2 ** -3)


def test_generator_gives_moshis_tokens():
    """tests/test_gpu.py's token test, smaller: greedy, fp32, an 8-frame context so the ring
    wraps, a slot joining late and one idling before its wrap: the project's kernels (ring
    attention, fused norms and gatings) give moshi's modules' tokens."""
    def greedy_tokens(ring: bool):
        torch.manual_seed(0)
        lm = tiny_moshi_lm("cpu", torch.float32, context=8)
        gen = SlotGenerator(lm, 3, cuda_graphs=False)
        if ring:
            ring_attention.install(lm.transformer)
            fused_ops.install(lm)
        try:
            for slot in range(3):
                gen.start(slot, SamplingParams(greedy=True))
            return greedy_tokens_of(gen, lambda i: [True, i % 3 != 0 or i > 6, i > 3], 16)
        finally:
            gen.close()

    ring, moshi = greedy_tokens(True), greedy_tokens(False)
    assert sum(map(len, ring)) > 30
    assert ring == moshi
