"""fp8 (e4m3) weights for the LM's linear layers (lm/fp8_weights.py) and the memory budget
(core/memory_budget.py). On a CPU the layers emulate `torch._scaled_mm`'s arithmetic; where
this torch has a CPU `_scaled_mm`, the emulation is checked against it; on CUDA, the Triton
quantization kernel, `_scaled_mm` and the step's CUDA graphs."""

import pytest
import torch
from conftest import tiny_moshi_lm, unforced_step
from moshi.modules.transformer import RingKVCache
from torch import nn
from torch.nn import functional as F

from personaplex_triton.core import loaders, memory_budget
from personaplex_triton.lm import fp8_weights, kv_cache
from personaplex_triton.lm.fp8_weights import FP8, Fp8Linear
from personaplex_triton.lm.generation import SlotGenerator
from personaplex_triton.lm.sampling import SamplingParams
from personaplex_triton.serving import stage_builds
from personaplex_triton.serving.parameters import TalkerConfig

GIB = memory_budget.GIB
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


def test_quantize_round_trip_within_e4m3_of_each_rows_scale():
    """Each row is scaled so its largest magnitude lands on 448: an element comes back within
    2^-4 of itself (3 mantissa bits, round to nearest) or, among e4m3's subnormals (below 2^-6
    before scaling), within half their step (2^-10) times the row's scale."""
    x = torch.randn(64, 512) * torch.logspace(-3, 3, 64)[:, None]
    values, scale = fp8_weights.quantize(x)
    assert values.dtype == FP8 and scale.shape == (64, 1) and scale.dtype == torch.float32
    back = fp8_weights.dequantize(values, scale)
    assert torch.all((back - x).abs() <= x.abs() * 2 ** -4 + scale * 2 ** -10)
    assert torch.equal(values.float().abs().amax(dim=1), torch.full((64,), 448.0))  # the full range used


def test_scales_are_per_output_channel():
    """A weight's rows (output channels) are quantized apart: scaling one row scales its scale
    alone and leaves every e4m3 value as it was; an all-zero row stays zero, not NaN."""
    w = torch.randn(48, 64)
    layer = Fp8Linear.from_linear(_linear(w))
    scaled = w.clone()
    scaled[5] *= 1000
    scaled[7] = 0
    other = Fp8Linear.from_linear(_linear(scaled))
    assert layer.scale.shape == (1, 48) and layer.weight.shape == (48, 64) and layer.weight.dtype == FP8
    assert torch.allclose(other.scale[0, 5], layer.scale[0, 5] * 1000, rtol=1e-6)
    rows = [r for r in range(48) if r != 7]
    assert torch.equal(other.weight.float()[rows], layer.weight.float()[rows])
    untouched = [r for r in rows if r != 5]
    assert torch.equal(other.scale[0, untouched], layer.scale[0, untouched])
    assert not other.weight.float()[7].any() and torch.isfinite(other(torch.randn(3, 64))).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_layer_is_close_to_the_original(dtype):
    """Weights and inputs each within e4m3's 2^-4: the output within a few percent of the
    original layer's (relative to its norm), in the input's dtype and shape."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 128, bias=False).to(dtype)
    x = torch.randn(4, 3, 256, dtype=dtype)
    out = Fp8Linear.from_linear(linear)(x)
    ref = F.linear(x.float(), linear.weight.float())
    assert out.dtype == dtype and out.shape == (4, 3, 128)
    assert (out.float() - ref).norm() / ref.norm() < 0.05


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="this torch has no _scaled_mm")
def test_the_emulation_is_the_scaled_matmul_of_this_torch():
    """The call CUDA makes (`scaled_matmul`: row-wise scales, the weight's transpose as the
    column-major operand) gives, on this torch's CPU `_scaled_mm`, what the emulation gives."""
    torch.manual_seed(0)
    x, w = torch.randn(5, 256), torch.randn(96, 256) * 0.02
    values, scale = fp8_weights.quantize(x)
    weight, weight_scale = fp8_weights.quantize(w)
    args = (values, scale, weight, weight_scale.t().contiguous(), torch.float32)
    try:
        fp8 = fp8_weights.scaled_matmul(*args)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"this torch's CPU _scaled_mm does not take row-wise scales: {exc}")
    torch.testing.assert_close(fp8, fp8_weights.emulated_matmul(*args), rtol=1e-5, atol=1e-6)


def test_a_layer_whose_dimensions_fp8_cannot_take_is_refused():
    with pytest.raises(ValueError, match="multiples of 16"):
        Fp8Linear.from_linear(nn.Linear(100, 64, bias=False))
    with pytest.raises(ValueError, match="bias-free"):
        Fp8Linear.from_linear(nn.Linear(64, 64))


def test_weight_dtype_parameter():
    assert fp8_weights.resolve("auto", "cpu") == torch.bfloat16
    assert fp8_weights.resolve("bfloat16", "cuda") == torch.bfloat16
    assert fp8_weights.resolve("float8_e4m3fn", "cuda:1") == FP8
    with pytest.raises(ValueError, match="weight_dtype must be bfloat16 or float8_e4m3fn; got 'int8'"):
        fp8_weights.resolve("int8", "cuda")
    with pytest.raises(ValueError, match="float8_e4m3fn needs a CUDA GPU"):
        fp8_weights.resolve("float8_e4m3fn", "cpu")


def test_fp8_weights_on_cuda_need_a_bf16_model():
    """_scaled_mm's row-wise scaling writes bf16: an fp32 model is refused before any layer is
    touched (no GPU needed to say so)."""
    lm = tiny_moshi_lm("cpu", torch.float32)
    with pytest.raises(ValueError, match="need a bfloat16 model"):
        fp8_weights.quantize_linears(lm, "cuda")
    assert type(lm.transformer.layers[0].self_attn.in_projs[0]) is nn.Linear


@pytest.fixture(scope="module")
def quantized():
    torch.manual_seed(0)
    lm = tiny_moshi_lm("cpu", torch.float32)
    bf16_bytes = fp8_weights.weight_bytes(lm)
    return lm, fp8_weights.quantize_linears(lm), bf16_bytes


def test_the_transformers_linears_are_quantized_and_the_rest_stays(quantized):
    """Every linear layer of the temporal transformer and the depformer (each codebook's own,
    a ModuleList each) and the depformer's input projections; not the embeddings, norms or
    output heads."""
    lm, count, before = quantized
    layers = len(lm.transformer.layers) + len(lm.depformer.layers) * lm.dep_q
    assert count == 4 * layers + lm.dep_q
    depformer = lm.depformer.layers[1]
    for layer in (lm.transformer.layers[0].self_attn.in_projs[0], lm.transformer.layers[1].gating.linear_out,
                  depformer.self_attn.out_projs[7], depformer.gating[15].linear_in, lm.depformer_in[3]):
        assert type(layer) is Fp8Linear
    assert type(lm.text_linear) is nn.Linear and all(type(h) is nn.Linear for h in lm.linears)
    assert lm.emb[0].weight.dtype == lm.transformer.layers[0].norm1.alpha.dtype == torch.float32
    assert not any(type(m) is nn.Linear for m in (*lm.transformer.modules(), *lm.depformer.modules()))
    assert fp8_weights.weight_bytes(lm) < before


@pytest.mark.parametrize("kv_dtype", [None, FP8], ids=["model-dtype-kv", "fp8-kv"])
def test_a_quantized_lm_steps_and_samples_tokens(quantized, kv_dtype):
    """The tiny LM with fp8 weights (emulated) in the slot generator: two conversations step,
    each sampling valid tokens once past the delays, with a KV cache of the model's dtype
    (moshi's own ring) or of fp8."""
    lm = quantized[0]
    gen = SlotGenerator(lm, 2, kv_dtype=kv_dtype)
    try:
        cache = lm.transformer.layers[0].self_attn._streaming_state.kv_cache
        assert type(cache) is (kv_cache.CastRingKVCache if kv_dtype else kv_cache.FilledRingKVCache)
        for slot in range(2):
            gen.start(slot, SamplingParams(greedy=True))
        outputs = [unforced_step(gen, [True, True], torch.randint(0, 2048, (2, 8)))
                   for _ in range(6)]
    finally:
        gen.close()
    tokens = torch.stack([t for t, has in outputs[2:]])
    assert all(bool(has.all()) for _, has in outputs[2:])
    assert bool((tokens[..., 0] < lm.text_card).all()) and bool((tokens[..., 1:] < lm.card).all())
    assert len(set(tokens[:, 0, 0].tolist())) > 1  # the text changes: the model runs, not a constant


def test_moshis_streaming_depformer_takes_fp8_projections(quantized):
    """moshi's own streaming of the depformer (its LMGen's step enters it) finds its cache's
    device and dtype on an nn.Linear, which the quantized projections are not: they get one of
    the activations' dtype."""
    lm = quantized[0]
    with lm.depformer.streaming(2):
        cache = lm.depformer.layers[0].self_attn._streaming_state.kv_cache
        assert type(cache) is RingKVCache and cache.cache.dtype == torch.float32 and cache.capacity == lm.dep_q
        out = lm.depformer(torch.randn(2, 1, lm.depformer.layers[0].self_attn.embed_dim))
    assert out.shape == (2, 1, lm.depformer.layers[0].self_attn.embed_dim) and torch.isfinite(out).all()


def test_the_planned_lm_holds_the_loaded_ones_bytes(quantized):
    """What the budget check counts before loading (a meta model) is what the quantized LM
    holds, in bf16 activations."""
    lm = quantized[0]
    kwargs = {**loaders.PERSONAPLEX_LM_KWARGS, **loaders.TINY_LM_SIZE}
    fp8 = fp8_weights.planned_lm(kwargs, FP8)
    scales = {id(m.scale) for m in lm.modules() if isinstance(m, Fp8Linear)}
    as_bf16 = sum(p.numel() * (1 if p.dtype == FP8 else 4 if id(p) in scales else 2) for p in lm.parameters())
    assert fp8_weights.weight_bytes(fp8) == as_bf16
    assert fp8_weights.weight_bytes(fp8_weights.planned_lm(kwargs, torch.bfloat16)) > as_bf16
    assert kv_cache.bytes_per_conversation(fp8.transformer, FP8) == kv_cache.bytes_per_conversation(lm.transformer, FP8)


def test_a_checkpoint_loads_with_fp8_weights(files):
    """load_lm: the checkpoint read in bf16 on the CPU and quantized onto the device (the CPU
    here); an fp32 model with fp8 weights is refused."""
    lm = fp8_weights.load_lm(files, "cpu", FP8)
    assert type(lm.transformer.layers[0].gating.linear_in) is Fp8Linear and lm.text_emb.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="fp8 weights run in a bfloat16 model"):
        fp8_weights.load_lm(files, "cpu", FP8, torch.float32)


def test_memory_budget_parameter():
    """Bytes of the parsed parameter (its text's checks: tests/test_model_configs.py)."""
    assert memory_budget.budget_bytes(None) is None  # auto: the whole card
    assert memory_budget.budget_bytes(24.0) == 24 * GIB and memory_budget.budget_bytes(15.5) == 31 * GIB // 2


def test_a_budget_too_small_for_the_weights_says_what_they_need():
    with pytest.raises(memory_budget.MemoryBudgetError,
                       match=r"weights \(7B, bfloat16\) need 15.59 GiB, more than the budget gpu_memory_gib = 15.00"):
        memory_budget.check_plan(15 * GIB, int(15.59 * GIB), GIB, GIB, "7B, bfloat16")
    with pytest.raises(memory_budget.MemoryBudgetError,
                       match=r"= 16.00 GiB holds no conversation: the LM's weights \(7B, bfloat16\) need 15.59 GiB, "
                             r"the plan keeps 1.00 GiB back"):
        memory_budget.check_plan(16 * GIB, int(15.59 * GIB), GIB, GIB // 2, "7B, bfloat16")


def test_conversations_in_a_budget():
    """(budget - weights - kept back) // per conversation; no budget: no bound."""
    assert memory_budget.check_plan(24 * GIB, 8 * GIB, 4 * GIB, 3 * GIB // 4, "fp8") == 16
    assert memory_budget.check_plan(16 * GIB, 8 * GIB, 4 * GIB, 3 * GIB // 4, "fp8") == 5
    assert memory_budget.check_plan(None, 8 * GIB, 4 * GIB, GIB, "fp8") == -1


def test_free_memory_within_a_budget():
    """The pool's sizing counts the card's free memory, at most the budget less what this
    process holds already, and never below zero."""
    assert memory_budget.free_bytes(24 * GIB, 60 * GIB, 9 * GIB) == 15 * GIB
    assert memory_budget.free_bytes(80 * GIB, 60 * GIB, 9 * GIB) == 60 * GIB
    assert memory_budget.free_bytes(8 * GIB, 60 * GIB, 9 * GIB) == 0
    memory_budget.limit_process(None, "cuda")  # no budget: the allocator is left alone (no GPU needed)


def test_the_talker_refuses_fp8_weights_on_a_cpu():
    """Through the model's parameters, before anything loads."""
    config = TalkerConfig.from_parameters({"weight_dtype": "float8_e4m3fn", "device": "cpu"}).resolved()
    with pytest.raises(ValueError, match="weight_dtype float8_e4m3fn needs a CUDA GPU .*this instance runs on cpu"):
        stage_builds.build_talker(config, emit=lambda *args: None)


def test_the_talkers_budget_check_weighs_the_7b_before_loading(files):
    """stage_builds.check_budget on the 7B's plan (a meta model, no GPU): bf16 weights (15.59 GiB)
    exceed a 12 GiB budget, and the error says to try fp8 ones; fp8 weights (8.27 GiB) with fp8
    KV hold one conversation in 24 GiB beside today's reserves and none in 16."""
    from personaplex_triton.mimi.runtime import open_step

    seven_b = loaders.CheckpointFiles(files.root, dict(loaders.PERSONAPLEX_LM_KWARGS))
    encoder = open_step("encoder", files, "torch", "cpu")  # its state per conversation: the 7B's Mimi
    config = TalkerConfig(device="cuda", kv_dtype="float8_e4m3fn", gpu_memory_gib=12.0)  # unresolved: no GPU
    with pytest.raises(memory_budget.MemoryBudgetError,
                       match=r"weights \(in bfloat16\) need 15.59 GiB, more than the budget gpu_memory_gib = 12.00 "
                             r"GiB; try weight_dtype float8_e4m3fn$"):
        stage_builds.check_budget(config, seven_b, torch.bfloat16, encoder, 12 * GIB, 0, False)
    assert stage_builds.check_budget(config, seven_b, FP8, encoder, 24 * GIB, 0, False) == 1
    with pytest.raises(memory_budget.MemoryBudgetError,
                       match=r"= 16.00 GiB holds no conversation: the LM's weights \(float8_e4m3fn linears\) need "
                             r"8.27 GiB, the plan keeps 14.73 GiB back beside the pool, and a conversation needs 0.74"):
        stage_builds.check_budget(config, seven_b, FP8, encoder, 16 * GIB, 0, False)


def _linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data.copy_(weight)
    return linear


# -- on CUDA -------------------------------------------------------------------------------------

@cuda
def test_the_triton_kernel_quantizes_rows_as_the_reference():
    """The kernel's scales are the reference's to an ulp (PyTorch's CUDA division by a scalar
    multiplies by its reciprocal; the kernel divides) and its e4m3 values are the same but for
    the rare element on a rounding boundary, one e4m3 step off; an all-zero row gives zeros."""
    x = torch.randn(7, 11264, device="cuda", dtype=torch.bfloat16) * 3
    x[3] = 0
    values, scale = fp8_weights.quantize_rows(x)
    ref_values, ref_scale = fp8_weights.quantize(x)
    torch.testing.assert_close(scale, ref_scale, rtol=2 ** -22, atol=0)
    differ = values.float() != ref_values.float()
    assert differ.float().mean() < 1e-3 and not values[3].float().any()
    torch.testing.assert_close(values.float(), ref_values.float(), rtol=2 ** -3, atol=2 ** -9)


@cuda
def test_scaled_mm_on_cuda_matches_the_emulation():
    torch.manual_seed(0)
    linear = nn.Linear(4096, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(linear)
    for rows in (1, 16, 64, 128):
        x = torch.randn(rows, 1, 4096, device="cuda", dtype=torch.bfloat16)
        values, scale = fp8_weights.quantize_rows(x.reshape(rows, -1))
        emulated = fp8_weights.emulated_matmul(values, scale, layer.weight, layer.scale, torch.bfloat16)
        out = layer(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 1, 1024)
        # By norm: fast accumulation (scaled_matmul) keeps partial sums in about 14 bits, so an
        # element near zero may differ by more than bf16's rounding; the whole, far less.
        error = (out.reshape(rows, -1).float() - emulated.float()).norm() / emulated.float().norm()
        assert error < 1e-2, f"{rows} rows: relative error {error:.2e}"


@cuda
def test_quantized_steps_under_cuda_graphs_match_eager():
    """The tiny LM, bf16, quantized onto the GPU from the CPU: its step captured in CUDA graphs
    samples what its eager step samples (greedy)."""
    torch.manual_seed(0)
    lm = tiny_moshi_lm("cpu", torch.bfloat16)
    fp8_weights.quantize_linears(lm, "cuda")
    lm.to("cuda")
    runs = []
    for graphs in (False, True):
        gen = SlotGenerator(lm, 4, cuda_graphs=graphs)
        codes = torch.Generator().manual_seed(1)
        for slot in range(4):
            gen.start(slot, SamplingParams(greedy=True))
        runs.append([unforced_step(gen, [True, True, False, True], torch.randint(0, 2048, (4, 8), generator=codes))[0]
                     .cpu() for _ in range(12)])
        gen.close()
    assert all(torch.equal(a, b) for a, b in zip(*runs))
