"""float8_e4m3fn weights for the LM's linear layers: the model parameter `weight_dtype`.

A step reads every weight once (15.6 GiB of the 7B in bf16), which bounds each tick from below
and leaves a smaller card no room for conversations. `quantize_linears` replaces each linear
layer of the temporal transformer and the depformer (attention projections, gatings, and the
depformer's input projection per codebook; the depformer's per-codebook weights are a
ModuleList of layers, each quantized on its own) by an `Fp8Linear`: its weight in e4m3, one fp32
scale per output channel, quantized at load from the checkpoint's bf16 weights. Embeddings,
norms and the output heads (text_linear, the depformer's `linears`) stay as they are.

On CUDA a layer quantizes its input per row on the GPU (one Triton kernel: the row's absolute
maximum, its scale, the e4m3 values) and multiplies with `torch._scaled_mm` (Hopper's fp8
tensor cores, both scales applied in the epilogue, the output in the activations' dtype): no
host sync and only the graph pool's allocations, so it runs inside the step's CUDA graphs.
Elsewhere it emulates that arithmetic: the same quantization of weights and inputs, dequantized,
multiplied in fp32, so the tests check the quantization on a CPU.
Serving refuses the parameter off CUDA (`resolve`).
"""

from __future__ import annotations

import types

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton
    triton = None

from . import kv_cache
from .kv_cache import FP8_MAX

FP8 = torch.float8_e4m3fn
# An all-zero row's scale stays positive, so that dividing by it gives zeros, not NaN.
MIN_AMAX = 1e-12
WEIGHT_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": FP8}
# _scaled_mm's fp8 GEMM takes inner and output dimensions in multiples of 16.
ALIGNMENT = 16


def resolve(configured: str, device: str) -> torch.dtype:
    """The `weight_dtype` parameter: "bfloat16" (also "" or "auto": the checkpoint's weights as
    loaded) or "float8_e4m3fn", which needs CUDA (Hopper's fp8 matmul)."""
    if configured in ("", "auto"):
        return torch.bfloat16
    if configured not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be {' or '.join(WEIGHT_DTYPES)}; got {configured!r}")
    dtype = WEIGHT_DTYPES[configured]
    if dtype == FP8 and torch.device(device).type != "cuda":
        raise ValueError(f"weight_dtype float8_e4m3fn needs a CUDA GPU (torch._scaled_mm on Hopper); "
                         f"this instance runs on {device}")
    return dtype


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [..., K] in e4m3, each scaled so its largest magnitude is FP8_MAX: (values
    [..., K] float8_e4m3fn, scales [..., 1] fp32), x ≈ values * scales. The reference of the
    Triton kernel, and how the weights are quantized (a weight's row is an output channel)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(MIN_AMAX) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`quantize`'s inverse, in fp32."""
    return values.float() * scale


if triton is not None:
    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, dim, stride_x, min_amax, fp8_max, BLOCK: tl.constexpr):
        """One row of `quantize`: its scale and its e4m3 values, in one pass. The divisions
        round as IEEE's (Triton's `/` is an approximate one), so the values are the reference's."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < dim
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), min_amax), fp8_max)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -fp8_max), fp8_max)
        tl.store(q_ptr + row * dim + cols, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)
        tl.store(scale_ptr + row, scale)


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` of rows [M, K]: on CUDA with Triton one kernel, elsewhere the reference."""
    if triton is None or not rows.is_cuda:
        return quantize(rows)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    values = torch.empty((m, k), device=rows.device, dtype=FP8)
    scale = torch.empty((m, 1), device=rows.device, dtype=torch.float32)
    block = triton.next_power_of_2(k)
    _quantize_rows_kernel[(m,)](rows, values, scale, k, rows.stride(0), MIN_AMAX, FP8_MAX, BLOCK=block,
                                num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4)
    return values, scale


def scaled_matmul(values: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """(values * scale) @ (weight * weight_scale).T through `torch._scaled_mm`: values [M, K]
    and weight [N, K] e4m3 (the weight's transpose is the column-major operand it takes),
    scale [M, 1] and weight_scale [1, N] fp32 (row-wise scaling). Fast accumulation (the fp8
    tensor cores' partial sums not promoted to fp32 every few steps) makes the row-wise kernel
    faster at the step's few rows, for an error far below the inputs' own rounding to e4m3."""
    return torch._scaled_mm(values, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=out_dtype,
                            use_fast_accum=True)


def emulated_matmul(values: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """`scaled_matmul`'s arithmetic without fp8 kernels: both operands dequantized, multiplied
    in fp32, rounded once to `out_dtype`."""
    return (dequantize(values, scale) @ dequantize(weight, weight_scale.t()).t()).to(out_dtype)


class Fp8Linear(nn.Module):
    """A bias-free linear layer with its weight [out, in] in e4m3 and one fp32 scale per output
    channel (`scale` [1, out]); its output has the dtype of its input."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Parameters (frozen): counted, moved and shared (deepcopy's memo) as the weights they replace.
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, device=None) -> Fp8Linear:
        """`linear` quantized per output channel, on `device` (None: the weight's)."""
        if linear.bias is not None:
            raise ValueError("Fp8Linear takes bias-free linear layers")
        out_features, in_features = linear.weight.shape
        if in_features % ALIGNMENT or out_features % ALIGNMENT:
            raise ValueError(f"fp8 weights need both dimensions in multiples of {ALIGNMENT}; "
                             f"this layer is {out_features} x {in_features}")
        values, scale = quantize(linear.weight.detach().to(device))
        return cls(values, scale.t().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        values, scale = quantize_rows(rows)
        matmul = scaled_matmul if x.is_cuda else emulated_matmul
        out = matmul(values, scale, self.weight, self.scale, x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8_e4m3fn"


def _quantized_children(module: nn.Module, device) -> int:
    """Every nn.Linear under `module` replaced by its Fp8Linear; returns how many."""
    count = 0
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            setattr(module, name, Fp8Linear.from_linear(child, device))
            count += 1
        else:
            count += _quantized_children(child, device)
    return count


def quantize_linears(lm, device=None) -> int:
    """Quantize `lm`'s temporal transformer and depformer linear layers and the depformer's
    input projections, in place (the module docstring), each on `device` (None: where it is),
    one at a time: an LM loaded on the CPU comes to the GPU without its bf16 linears ever being
    there. Returns how many layers. The rest of `lm` stays where and as it is (`lm.to(device)`
    afterwards moves it)."""
    from moshi.modules.transformer import StreamingMultiheadAttention

    model_dtype = lm.text_emb.weight.dtype
    if torch.device(device or lm.text_emb.weight.device).type == "cuda" and model_dtype != torch.bfloat16:
        raise ValueError(f"fp8 weights on CUDA need a bfloat16 model (_scaled_mm's row-wise scaling "
                         f"writes bf16); this one is {model_dtype}")
    count = sum(_quantized_children(part, device) for part in (lm.transformer, lm.depformer, lm.depformer_in))
    for module in (*lm.transformer.modules(), *lm.depformer.modules()):
        if isinstance(module, StreamingMultiheadAttention):
            # moshi's own streaming state reads its cache's device and dtype off an nn.Linear
            module._init_streaming_state = types.MethodType(kv_cache.state_initializer(model_dtype), module)
    return count


def weight_bytes(lm) -> int:
    """The bytes of `lm`'s parameters (fp8 weights and their scales included)."""
    return sum(p.numel() * p.element_size() for p in lm.parameters())


def planned_lm(lm_kwargs: dict, weight_dtype: torch.dtype, dtype: torch.dtype = torch.bfloat16):
    """moshi's LMModel of `lm_kwargs` in `dtype` on the meta device (no memory), quantized there
    for fp8: what the weights (`weight_bytes`) and a conversation's KV cache
    (kv_cache.bytes_per_conversation of its transformer) will take, before loading any."""
    from moshi.models.lm import LMModel

    lm = LMModel(device="meta", dtype=dtype, **lm_kwargs)
    if weight_dtype == FP8:
        quantize_linears(lm)
    return lm


def load_lm(files, device: str, weight_dtype: torch.dtype, dtype: torch.dtype | None = None):
    """The checkpoint's LM on `device` with weights of `weight_dtype` (`resolve`): bf16 as
    loaders.get_lm loads it; fp8 loaded on the CPU in bf16 and quantized layer by layer onto the
    device, so that the card never holds the bf16 linears (a 16 GB card cannot)."""
    from ..core import loaders

    if weight_dtype != FP8:
        return loaders.get_lm(files, device, dtype)
    if dtype not in (None, torch.bfloat16):
        raise ValueError(f"fp8 weights run in a bfloat16 model; dtype {dtype} was asked for")
    lm = loaders.get_lm(files, "cpu", torch.bfloat16)
    quantize_linears(lm, device)
    lm.to(device)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the pool's sizing reads the free memory next
    return lm
