"""The KV cache's storage dtype (kv_cache.py), on the CPU: against
moshi's `RingKVCache.complete()` and its attention in fp32, the reference."""

import pytest
import torch
from conftest import snapshot_tensors, tiny_moshi_lm
from moshi.modules.transformer import RingKVCache

from personaplex_triton.lm import kv_cache
from personaplex_triton.lm.generation import SlotGenerator, StepInputs
from personaplex_triton.lm.sampling import SamplingParams

FP8 = torch.float8_e4m3fn


def test_fp8_round_trip_within_e4m3_and_saturating():
    """e4m3 keeps 3 mantissa bits: within 2^-4 relative (round to nearest) above its subnormals
    (2^-6); past +-448 a value saturates, never NaN."""
    x = torch.randn(10_000) * 30
    back = kv_cache.store(x, FP8).float()
    normal = x.abs() >= 2 ** -6
    assert torch.all((back - x)[normal].abs() <= x[normal].abs() * 2 ** -4)
    assert torch.all((back - x)[~normal].abs() <= 2 ** -10)
    outliers = kv_cache.store(torch.tensor([1e4, -1e4, float("inf"), 448.0]), FP8).float()
    assert outliers.tolist() == [448.0, -448.0, 448.0, 448.0]
    assert kv_cache.store(x, torch.bfloat16).dtype == torch.bfloat16


def test_kv_dtype_parameter():
    assert kv_cache.resolve("auto", "cpu", torch.float32) == torch.float32
    assert kv_cache.resolve("", "cuda", torch.bfloat16) == torch.bfloat16
    assert kv_cache.resolve("float8_e4m3fn", "cuda:1", torch.bfloat16) == FP8
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        kv_cache.resolve("float8_e4m3fn", "cpu", torch.float32)
    with pytest.raises(ValueError, match="kv_dtype must be"):
        kv_cache.resolve("fp8", "cuda", torch.bfloat16)


def test_talker_refuses_fp8_on_a_cpu(tiny_checkpoint):
    """The talker parameter reaches the service, which says why before it allocates a pool."""
    from personaplex_triton.serving.parameters import TalkerConfig
    from personaplex_triton.serving.serving import TalkerService

    with pytest.raises(ValueError, match="float8_e4m3fn needs a CUDA GPU"):
        TalkerService(TalkerConfig(checkpoint=str(tiny_checkpoint), max_conversations=2, device="cpu",
                                   kv_dtype="float8_e4m3fn"))


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    return tiny_moshi_lm("cpu", torch.float32, context=12)


def test_bytes_per_conversation(lm):
    """2 (keys, values) x layers x context x dim x bytes; fp8 half of bf16."""
    bf16 = kv_cache.bytes_per_conversation(lm.transformer, torch.bfloat16)
    assert bf16 == 2 * len(lm.transformer.layers) * 12 * lm.dim * 2
    assert kv_cache.bytes_per_conversation(lm.transformer, FP8) * 2 == bf16


@pytest.mark.parametrize("stored", [FP8, torch.bfloat16])
def test_cast_cache_completes_as_moshi_on_the_stored_values(stored):
    """moshi's attention over a cache of another dtype: the same positions, and the entries it
    reads are what the cache stores, upcast."""
    torch.manual_seed(1)
    device = torch.device("cpu")
    cast = kv_cache.CastRingKVCache(2, 2, 4, 6, device=device, dtype=stored)
    reference = RingKVCache(2, 2, 4, 6, device=device, dtype=torch.float32)
    for T in (4, 1, 1, 3):  # a prefill chunk, two frames, a chunk across the wrap
        k, v = 100 * torch.randn(2, 2, 2, T, 4)
        k[0, 0, 0, 0] = 1e4  # saturates
        mask = torch.ones(2, dtype=torch.bool)
        got = cast.complete(k, v, mask)
        want = reference.complete(kv_cache.store(k, stored).float(), kv_cache.store(v, stored).float(), mask)
        assert got.keys.dtype == torch.float32
        assert torch.equal(got.positions, want.positions)
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)


def test_fp8_attention_close_to_fp32(lm):
    """The temporal transformer through moshi's attention with an fp8 cache (a 7-frame prefill
    chunk, then frames past the 12-entry ring's wrap) stays close to the fp32 cache's."""
    outputs = {}
    for dtype in (torch.float32, FP8):
        kv_cache.store_in(lm.transformer, dtype)
        torch.manual_seed(2)
        with lm.transformer.streaming(2):
            caches = [m._streaming_state.kv_cache for m in kv_cache.self_attentions(lm.transformer)]
            assert all(c.cache.dtype == dtype for c in caches)
            outputs[dtype] = [lm.transformer(torch.randn(2, 7, lm.dim))]
            outputs[dtype] += [lm.transformer(torch.randn(2, 1, lm.dim)) for _ in range(9)]
    kv_cache.store_in(lm.transformer, torch.float32)
    for ref, fp8 in zip(outputs[torch.float32], outputs[FP8]):
        assert torch.linalg.norm(fp8 - ref) <= 0.05 * torch.linalg.norm(ref)


def test_fp8_pool_snapshot_restore(lm):
    """A slot's fp8 KV rows survive snapshot and restore into another slot, byte for byte, and
    both slots then sample the same greedy tokens."""
    gen = SlotGenerator(lm, 3, cuda_graphs=False, kv_dtype=FP8)
    try:
        assert gen.kv_dtype == FP8
        gen.start(0, SamplingParams(greedy=True))
        rng = torch.Generator().manual_seed(3)

        def step(active, user):
            none = torch.zeros(3, dtype=torch.bool)
            tokens, _, _ = gen.step(StepInputs(torch.tensor(active), user, torch.zeros(3, 8, dtype=torch.long), none,
                                               torch.zeros(3, dtype=torch.long), none))
            return tokens

        for _ in range(15):  # past the 12-entry ring's wrap
            step([True, False, False], torch.randint(0, 2048, (3, 8), generator=rng))
        snap = gen.snapshot(0)
        kv = snap["modules"]["kv"]
        assert kv.dtype == FP8 and kv.shape[3] == 12
        gen.start(2, SamplingParams(greedy=True))
        gen.restore([2], snap)
        for state in gen.states.states():
            if getattr(state, "kv_cache", None) is not None:
                raw = state.kv_cache.cache.view(torch.uint8)
                assert torch.equal(raw[:, 0], raw[:, 2])
        for _ in range(3):
            user = torch.randint(0, 2048, (1, 8), generator=rng).expand(3, 8)
            tokens = step([True, False, True], user)
            assert torch.equal(tokens[0], tokens[2])
    finally:
        gen.close()


def test_a_pass_through_one_slots_buffers_leaves_the_slot_as_a_pass_on_its_row(lm):
    """prefill_graphs.py's graphed pass, run eagerly: one slot's state and the head of its ring
    gathered into one-row buffers of a whole ring (slot_states.CarriedRows), two passes of the
    transformer there, the head written back: the slot holds what two passes on its own row
    leave, entry for entry, whatever the pool's ring and the buffers held past the head (a
    conversation's leftovers, an earlier slot's), which stays as it was; no other slot changes."""
    gen = SlotGenerator(lm, 3, cuda_graphs=False)
    head = 10  # PrefillPasses.head: the longest prefill (8 positions here)
    try:
        rng = torch.Generator().manual_seed(5)
        chunks = [torch.randn(1, t, lm.dim, generator=rng) for t in (5, 3)]
        gen.start_many({1: SamplingParams(), 2: SamplingParams()})
        rings = [s.kv_cache for s in gen.states.states() if getattr(s, "kv_cache", None) is not None]
        for kv in rings:  # leftovers past the head, in the pool's ring of both slots
            kv.cache[:, 1:3, :, head:] = torch.randn(kv.cache[:, 1:3, :, head:].shape, generator=rng).to(kv.cache)
        leftovers = [kv.cache[:, 2, :, head:].clone() for kv in rings]
        untouched = gen.snapshot(0)
        end = 0
        for chunk in chunks:  # slot 1: on its own row (the eager path)
            end += chunk.shape[1]
            gen.prefill.run(1, chunk, end)
        buffers = gen.states.one_slot()
        for _, _, view in buffers.views:  # an earlier slot's entries in the buffers, past the head
            if getattr(view, "kv_cache", None) is not None:
                view.kv_cache.cache[:, :, :, head:] = torch.randn(view.kv_cache.cache[:, :, :, head:].shape,
                                                                  generator=rng).to(view.kv_cache.cache)
        for chunk in chunks:  # slot 2: through the buffers, as the graph does
            buffers.load(torch.tensor([2]), torch.tensor([True]), filled=head)
            with buffers.seen():
                lm.transformer(chunk)
            buffers.store(filled=head - 1)
        for state in gen.states.states():
            for name, value in vars(state).items():
                if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == 3 and name != "exec_mask":
                    assert torch.equal(value[1], value[2]), name
        for kv, leftover in zip(rings, leftovers, strict=True):
            assert kv.end_offset[1] == kv.end_offset[2] == 8
            assert torch.equal(kv.cache[:, 2, :, :8], kv.cache[:, 1, :, :8])
            assert torch.equal(kv.cache[:, 2, :, :head][:, :, 8:], torch.zeros_like(kv.cache[:, 2, :, 8:head]))
            assert torch.equal(kv.cache[:, 2, :, head:], leftover)
        assert len(rings) == len(lm.transformer.layers)
        after = snapshot_tensors(gen.snapshot(0))  # (the eager pass sets every slot's exec mask)
        assert all(torch.equal(value, after[name]) for name, value in snapshot_tensors(untouched).items())
    finally:
        gen.close()
