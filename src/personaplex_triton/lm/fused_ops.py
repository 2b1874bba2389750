"""One Triton kernel each for the step's RMS norms and gated feed-forward activations, on CUDA.

At one conversation a 7B step is bound by kernel count, not by bytes: moshi's fp32 RMS norm is
nine kernels (cast, square, mean, add, rsqrt, cast, two products, cast back) and its gating's
activation two, each a launch of a few microseconds even inside a CUDA graph, over 64 norms and
32 gatings in the temporal transformer and 96 norms and 48 gatings in the depformer's 8
codebooks. Each becomes one kernel here, doing the same arithmetic in the same precision (fp32
for the norm, the activation rounded to the model's dtype before its product, as moshi's eager
ops round).

`install` routes every RMSNorm and SiLU gating module of a model through these kernels; the
linear layers stay moshi's (cuBLAS) or fp8_weights.py's. Elsewhere (the CPU, no Triton) moshi's modules run, and
they are the reference in tests.
"""

from __future__ import annotations

import types

import torch
from moshi.modules.gating import ActivationGating
from moshi.modules.transformer import RMSNorm
from torch.nn import functional as F

from .fp8_weights import Fp8Linear

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton
    triton = None

GATE_BLOCK = 1024  # hidden units per program of the gating's activation


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, alpha_ptr, out_ptr, dim, stride_x, eps, BLOCK: tl.constexpr):
        """One row: x * alpha / sqrt(eps + mean(x^2)), in fp32, stored in the output's dtype."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < dim
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        var = eps + tl.sum(x * x, axis=0) / dim
        alpha = tl.load(alpha_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        y = x * (alpha * tl.rsqrt(var))
        tl.store(out_ptr + row * dim + cols, y.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _silu_gate_kernel(h_ptr, out_ptr, hidden, stride_h, BLOCK: tl.constexpr):
        """silu(h[:hidden]) * h[hidden:] for one row's block of hidden units; the activation is
        rounded to the dtype before the product, as two eager ops would."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < hidden
        a = tl.load(h_ptr + row * stride_h + cols, mask=inside, other=0.0).to(tl.float32)
        gate = tl.load(h_ptr + row * stride_h + hidden + cols, mask=inside, other=0.0)
        dtype = out_ptr.dtype.element_ty
        activated = (a / (1.0 + tl.exp(-a))).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * hidden + cols, (activated * gate.to(tl.float32)).to(dtype), mask=inside)


def rms_norm(x: torch.Tensor, alpha: torch.Tensor, eps: float) -> torch.Tensor:
    """moshi's fp32 RMS norm (`rms_norm_f32`) over the last dim of x [..., D], in x's dtype."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    _rms_norm_kernel[(rows.shape[0],)](rows, alpha, out, dim, rows.stride(0), eps,
                                       BLOCK=triton.next_power_of_2(dim))
    return out


def silu_gate(h: torch.Tensor) -> torch.Tensor:
    """silu(first half) * second half of the last dim of h [..., 2 * hidden], in h's dtype."""
    hidden = h.shape[-1] // 2
    rows = h.reshape(-1, 2 * hidden)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*h.shape[:-1], hidden), device=h.device, dtype=h.dtype)
    _silu_gate_kernel[(rows.shape[0], triton.cdiv(hidden, GATE_BLOCK))](rows, out, hidden, rows.stride(0),
                                                                        BLOCK=GATE_BLOCK)
    return out


def _norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, self.alpha, self.eps)


def _gating_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.linear_out(silu_gate(self.linear_in(x)))


_LINEARS = (torch.nn.Linear, Fp8Linear)


def _routed(model):
    """The modules `install` routes: fp32 RMS norms and SiLU gatings with plain or fp8 linear layers."""
    for module in model.modules():
        if isinstance(module, RMSNorm) and module.dtype == torch.float32:
            yield module, _norm_forward
        elif (isinstance(module, ActivationGating) and module.activation is F.silu
              and type(module.linear_in) in _LINEARS and type(module.linear_out) in _LINEARS):
            yield module, _gating_forward


def install(model) -> int:
    """Route `model`'s norms and gatings through the kernels; returns how many modules.
    Only on CUDA with Triton (ring_attention.available)."""
    routed = list(_routed(model))
    for module, forward in routed:
        module.forward = types.MethodType(forward, module)
    return len(routed)


def uninstall(model) -> None:
    """Back to moshi's modules (the reference)."""
    for module, _ in _routed(model):
        module.__dict__.pop("forward", None)
