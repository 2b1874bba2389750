"""Mimi's encoder and decoder as explicit-state streaming steps.

moshi keeps Mimi's streaming state inside its modules (ring KV caches, conv buffers, exec
masks). Here one 80 ms step is a pure function of its input and the state tensors, batch
dimension first, so that the same step runs in PyTorch, exports to ONNX with a dynamic batch
and builds into a TensorRT engine, and so that a slot pool can hold each conversation's state.
The steps reuse Mimi's own modules and weights; only the streaming bookkeeping is rewritten:

- a causal conv keeps its last `kernel - stride` input samples (moshi's `previous`);
- a transposed conv keeps its overlapping tail (moshi's `partial`);
- attention keeps the last `context` keys and values as a sliding window (concatenate, keep
  the last `context`), with an additive mask built from the stream's offset. That sees
  exactly the keys moshi's ring buffer sees, without Scatter or Mod ops.

State of a stream = [offset (int64, transformer steps done)] + the tensors its modules take,
in the order they take them. A fresh stream is all zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from moshi.modules.conv import StreamingConv1d, StreamingConvTranspose1d
from moshi.modules.seanet import SEANetResnetBlock
from moshi.modules.transformer import ProjectedTransformer, StreamingTransformerLayer

from .contract import FRAME_SAMPLES
from .seam import NUM_AGENT_CODEBOOKS


@dataclass(frozen=True)
class TensorSpec:
    """A step input or output: its name, shape after the batch dimension, and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class _StateIO:
    """Hands a step's incoming state tensors to the modules in order, collects the outgoing
    ones. With no incoming states it makes zeros instead, which is how a fresh state (and its
    specs) comes about: the order is the one the step itself uses."""

    def __init__(self, states: tuple[torch.Tensor, ...] | None, batch: int, like: torch.Tensor):
        self._incoming = None if states is None else iter(states)
        self._batch, self._like = batch, like
        self.taken: list[torch.Tensor] = []
        self.given: list[torch.Tensor] = []

    def take(self, *shape: int) -> torch.Tensor:
        if self._incoming is None:
            state = self._like.new_zeros((self._batch, *shape))
        else:
            state = next(self._incoming)
        self.taken.append(state)
        return state

    def give(self, state: torch.Tensor) -> None:
        self.given.append(state)


def _conv(conv: StreamingConv1d, x: torch.Tensor, io: _StateIO, first: torch.Tensor | None) -> torch.Tensor:
    kept = conv._effective_kernel_size - conv._stride
    if kept == 0:
        return conv.conv(x)
    previous = io.take(x.shape[1], kept)
    if conv.pad_mode == "replicate":  # moshi primes a fresh buffer with the first sample
        previous = torch.where(first.view(-1, 1, 1), x[..., :1].expand_as(previous), previous)
    x = torch.cat([previous, x], dim=-1)
    io.give(x[..., x.shape[-1] - kept:])
    return conv.conv(x)


def _transposed_conv(inner: nn.ConvTranspose1d, x: torch.Tensor) -> torch.Tensor:
    """`inner(x)` as one matrix product (an elementwise one when depthwise) and an overlap-add.
    ONNX Runtime's ConvTranspose on the CPU ran the decoder's upsampling at a few GMAC/s and
    streamed its weights once per stream of the batch; here the product is [B * L, C_in] @
    [C_in, C_out * kernel], one pass over the weights for the whole batch."""
    B, _, L = x.shape
    k, s = inner.kernel_size[0], inner.stride[0]
    c_out, overlaps = inner.out_channels, -(-k // s)  # overlaps: input steps an output block sums
    if inner.padding[0] or inner.dilation[0] != 1 or inner.output_padding[0]:
        raise TypeError("Mimi's transposed convs: no padding, no dilation")
    weight = F.pad(inner.weight, (0, overlaps * s - k))  # [C_in, C_out / groups, overlaps * s]
    if inner.groups == 1:
        # 2-D, so that ONNX Runtime runs one GEMM (a transposed 3-D operand became a FusedMatMul
        # that ran per stream)
        z = x.transpose(1, 2).reshape(B * L, -1) @ weight.flatten(1)  # [B * L, C_out * overlaps * s]
    elif inner.groups == inner.in_channels == c_out:
        z = x.transpose(1, 2)[..., None] * weight[:, 0]  # [B, L, C, overlaps * s]
    else:
        raise TypeError("Mimi's transposed convs: plain or depthwise")
    z = z.reshape(B, L, c_out, overlaps, s)
    # output block t + i (s samples) gets input step t's i-th slice of the kernel
    blocks = sum(F.pad(z[:, :, :, i], (0, 0, 0, 0, i, overlaps - 1 - i)) for i in range(overlaps))
    y = blocks.permute(0, 2, 1, 3).reshape(B, c_out, (L + overlaps - 1) * s)[..., :(L - 1) * s + k]
    return y if inner.bias is None else y + inner.bias[:, None]


def _conv_transpose(convtr: StreamingConvTranspose1d, x: torch.Tensor, io: _StateIO) -> torch.Tensor:
    inner = convtr.convtr.convtr
    overlap = convtr._kernel_size - convtr._stride
    partial = io.take(inner.out_channels, overlap)
    y = _transposed_conv(inner, x)
    y = torch.cat([y[..., :overlap] + partial, y[..., overlap:]], dim=-1)
    tail = y[..., y.shape[-1] - overlap:]
    io.give(tail if inner.bias is None else tail - inner.bias[:, None])
    return y[..., : y.shape[-1] - overlap]


def _seanet(module: nn.Module, x: torch.Tensor, io: _StateIO) -> torch.Tensor:
    """SEANet's encoder or decoder (convs, transposed convs, residual blocks, activations)."""
    if isinstance(module, StreamingConv1d):
        return _conv(module, x, io, first=None)
    if isinstance(module, StreamingConvTranspose1d):
        return _conv_transpose(module, x, io)
    if isinstance(module, SEANetResnetBlock):
        return _seanet(module.shortcut, x, io) + _seanet(module.block, x, io)
    if isinstance(module, nn.Sequential):
        for child in module:
            x = _seanet(child, x, io)
        return x
    if hasattr(module, "model") and isinstance(module.model, nn.Sequential):  # SEANetEncoder/Decoder
        return _seanet(module.model, x, io)
    if isinstance(module, (nn.ELU, nn.Identity)):
        return module(x)
    raise TypeError(f"no explicit-state step for {type(module).__name__}")


def _attention_layer(layer: StreamingTransformerLayer, x: torch.Tensor, offset: torch.Tensor,
                     io: _StateIO) -> torch.Tensor:
    attn = layer.self_attn
    if attn.kv_repeat != 1 or attn.weights_per_step or layer.gating is not None or attn.context is None:
        raise TypeError("Mimi's transformer layers: plain MHA with a context, ungated MLP")
    B, T, _ = x.shape
    H, context = attn.num_heads, attn.context
    D = attn.embed_dim // H
    q, k, v = attn.in_projs[0](layer.norm1(x)).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
    q, k = attn.rope(q, k, offset, time_before_heads=False)

    # keys and values in two states: one window of both cost a split and a stack (copies) a step
    keys = torch.cat([io.take(H, context, D), k], dim=2)[:, :, T:]
    values = torch.cat([io.take(H, context, D), v], dim=2)[:, :, T:]
    io.give(keys)
    io.give(values)

    steps = torch.arange(context, device=x.device) - context
    pos_k = offset.view(B, 1) + T + steps                                 # [B, context]
    pos_q = offset.view(B, 1) + torch.arange(T, device=x.device)          # [B, T]
    delta = pos_q[:, :, None] - pos_k[:, None, :]
    visible = (pos_k[:, None, :] >= 0) & (delta >= 0) & (delta < context)
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=x.device).masked_fill(~visible, float("-inf"))
    out = F.scaled_dot_product_attention(q, keys, values, mask[:, None])
    x = x + layer.layer_scale_1(attn.out_projs[0](out.transpose(1, 2).reshape(B, T, H * D)))
    update = layer.linear2(layer.activation(layer.linear1(layer.norm2(x))))
    return x + layer.layer_scale_2(update)


def _transformer(projected: ProjectedTransformer, x: torch.Tensor, offset: torch.Tensor,
                 io: _StateIO) -> torch.Tensor:
    """[B, C, T] in conv layout through Mimi's streaming transformer."""
    transformer = projected.transformer
    if transformer.positional_embedding != "rope" or not projected.conv_layout:
        raise TypeError("Mimi's transformer: RoPE positions, conv layout")
    x = x.transpose(1, 2)
    if projected.input_proj is not None:
        x = projected.input_proj(x)
    for layer in transformer.layers:
        x = _attention_layer(layer, x, offset, io)
    return projected.output_projs[0](x).transpose(1, 2)


class MimiStep(nn.Module):
    """One 80 ms streaming step of half of Mimi: (input, offset, *state) -> (output, offset, *state)."""

    input: TensorSpec
    output: TensorSpec

    def __init__(self, mimi):
        super().__init__()
        self.mimi = mimi

    def _step(self, x: torch.Tensor, offset: torch.Tensor, io: _StateIO) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, offset: torch.Tensor, *states: torch.Tensor):
        io = _StateIO(states, x.shape[0], self._like)
        y = self._step(x, offset, io)
        return (y, offset + self.transformer_steps, *io.given)

    @property
    def _like(self) -> torch.Tensor:
        return next(self.mimi.parameters())

    @property
    def transformer_steps(self) -> int:
        """Transformer positions per 80 ms frame (Mimi's inner 25 Hz against 12.5 Hz)."""
        return round(self.mimi.encoder_frame_rate / self.mimi.frame_rate)

    @torch.no_grad()
    def initial_state(self, batch: int) -> list[torch.Tensor]:
        """A fresh stream: offset 0 and zeroed state tensors, on Mimi's device."""
        like = self._like
        io = _StateIO(None, batch, like)
        x = torch.zeros((batch, *self.input.shape), dtype=self.input.dtype, device=like.device)
        offset = torch.zeros(batch, dtype=torch.long, device=like.device)
        self._step(x, offset, io)
        return [offset, *io.taken]

    def state_specs(self) -> list[TensorSpec]:
        states = self.initial_state(1)
        return [TensorSpec("offset", (), torch.long)] + [
            TensorSpec(f"state{i}", tuple(s.shape[1:]), s.dtype) for i, s in enumerate(states[1:])]


class MimiDecoderStep(MimiStep):
    """Agent codes [B, 8, 1] -> 24 kHz PCM [B, 1, 1920]."""

    input = TensorSpec("codes", (NUM_AGENT_CODEBOOKS, 1), torch.long)
    output = TensorSpec("pcm", (1, FRAME_SAMPLES), torch.float32)

    def _step(self, codes, offset, io):
        mimi = self.mimi
        emb = _conv_transpose(mimi.upsample.convtr, mimi.decode_latent(codes), io)
        emb = _transformer(mimi.decoder_transformer, emb, offset, io)
        return _seanet(mimi.decoder, emb, io)


class MimiEncoderStep(MimiStep):
    """24 kHz PCM [B, 1, 1920] -> codes [B, 8, 1]."""

    input = TensorSpec("pcm", (1, FRAME_SAMPLES), torch.float32)
    output = TensorSpec("codes", (NUM_AGENT_CODEBOOKS, 1), torch.long)

    def _step(self, pcm, offset, io):
        mimi = self.mimi
        emb = _seanet(mimi.encoder, pcm, io)
        emb = _transformer(mimi.encoder_transformer, emb, offset, io)
        emb = _conv(mimi.downsample.conv, emb, io, first=offset == 0)
        return mimi.quantizer.encode(emb)


STEPS = {"decoder": MimiDecoderStep, "encoder": MimiEncoderStep}
