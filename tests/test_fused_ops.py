"""The step's one-kernel ops on the CPU, through OpenAI Triton's interpreter, against moshi's
modules (the reference): the RMS norm and the gating activation (fused_ops.py), and the decode's
RoPE and ring write (ring_attention.rope_and_store). tests/test_gpu.py runs the step with them on
CUDA.

    TRITON_INTERPRET=1 PYTHONPATH=/path/to/triton:src .venv/bin/python -m pytest tests/test_fused_ops.py
"""

import os

import pytest
import torch
from conftest import rope_and_store_against_moshi, tiny_moshi_lm
from moshi.modules.gating import ActivationGating
from moshi.modules.transformer import RMSNorm
from torch.nn import functional as F

from personaplex_triton.lm import fused_ops, kv_cache, ring_attention

pytestmark = pytest.mark.skipif(
    fused_ops.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs OpenAI Triton with TRITON_INTERPRET=1 (its interpreter runs the kernels on the CPU)")

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_moshis(dtype):
    """moshi's fp32 norm over a width that is no power of two, rows of [3, 2, 40] and a strided
    input: fp32 to rounding, bf16 at most one rounding step apart (a sum in another order)."""
    torch.manual_seed(0)
    norm = RMSNorm(40, eps=1e-8, dtype=torch.float32).to(dtype)
    with torch.no_grad():
        norm.alpha.normal_()
    x = 3 * torch.randn(3, 2, 80, dtype=dtype)[..., ::2]
    got, want = fused_ops.rms_norm(x, norm.alpha, norm.eps), norm(x)
    assert got.dtype == dtype and got.shape == want.shape
    tolerance = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gating_is_moshis(dtype):
    """A SiLU gating module routed by `install` gives moshi's output; 1500 hidden units take two
    programs a row, the last one partly."""
    torch.manual_seed(1)
    gating = ActivationGating(24, 2250, F.silu).to(dtype)
    x = torch.randn(3, 1, 24, dtype=dtype)
    with torch.no_grad():
        want = gating(x)
        assert fused_ops.install(gating) == 1
        try:
            got = gating(x)
        finally:
            fused_ops.uninstall(gating)
    assert gating.linear_in.out_features == 2 * 1500 and got.dtype == dtype
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)


def test_install_routes_every_norm_and_gating_of_the_lm():
    """Every temporal and depformer norm and gating of PersonaPlex's LM, and uninstall undoes it."""
    lm = tiny_moshi_lm("cpu", torch.float32)
    norms = [m for m in lm.modules() if isinstance(m, RMSNorm)]
    gatings = [m for m in lm.modules() if isinstance(m, ActivationGating)]
    assert fused_ops.install(lm) == len(norms) + len(gatings)
    assert len(gatings) == len(lm.transformer.layers) + len(lm.depformer.layers) * lm.dep_q
    assert all("forward" in vars(m) for m in norms + gatings)
    fused_ops.uninstall(lm)
    assert not any("forward" in vars(m) for m in norms + gatings)


# The interpreter's fp32 -> float8_e4m3fn conversion is wrong at binade edges (7.8 gives 4):
# tests/test_gpu.py runs the fp8 cases on CUDA.
INTERPRETER_FP8 = pytest.mark.skip(reason="Triton's interpreter mis-rounds float8_e4m3fn stores; CUDA runs it")


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16, pytest.param(FP8, marks=INTERPRETER_FP8)])
def test_rope_and_store_is_moshis_rope_and_complete(stored):
    # Triton's interpreter rounds fp32 to bf16 toward zero, CUDA to nearest: one step apart
    rope_and_store_against_moshi("cpu", stored, rtol=2 ** -7 if stored == torch.bfloat16 else 1e-5)


def test_rope_and_store_saturates_fp8():
    """A key past float8_e4m3fn's range is stored as its largest value, not as NaN."""
    cache = kv_cache.CastRingKVCache(1, 1, 4, 3, device=torch.device("cpu"), dtype=FP8)
    projected = torch.tensor([[[0.0, 0, 0, 0, 1e4, -1e4, 1, 2, 3, 4, 5, 6]]])
    ring_attention.rope_and_store(projected, torch.zeros(1, dtype=torch.long), cache,
                                  torch.ones(1, dtype=torch.bool), 1, None)
    assert cache.cache[:, 0, 0, 0].float().tolist() == [[448, -448, 1, 2], [3, 4, 5, 6]]
