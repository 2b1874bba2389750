"""Mimi's encoder and decoder as explicit-state streaming steps.

moshi keeps Mimi's streaming state inside its modules (ring KV caches, conv buffers, exec
masks). Here one 80 ms step is a pure function of its input and the state tensors, batch
dimension first, so that the same step runs in PyTorch, exports to ONNX with a dynamic batch
and builds into a TensorRT engine, and so that a slot pool can hold each conversation's state.
The steps reuse Mimi's own modules and weights (some weights laid out anew, once, for the
products below); the streaming bookkeeping is rewritten, and the layers run as ONNX Runtime
runs them fast on a CPU, time-major ([B, T, C]) from the input to the output:

- a causal conv keeps its last `kernel - stride` input samples (moshi's `previous`),
  [B, kept, C], and runs as one matrix product over frames of `stride` samples;
- a transposed conv (kernel twice the stride) keeps its last input step, [B, 1, C_in], and
  runs as a causal conv of kernel 2 over the input (moshi keeps the overlapping output);
- attention keeps the last `context` keys and values in a ring, each position in slot
  `position % context` (keys transposed, [B, H, D, context]; values [B, H, context, D]). A
  step reads the ring but does not write it: it attends to the ring's entries that its own
  new keys do not displace, and to those new keys, with additive masks built from the
  stream's offset. That sees exactly the keys moshi's ring buffer sees. Each head's query and
  key dimensions are reordered (see _weight_halves), so the keys in the state are in that
  order too.

State of a stream = [offset (int64, transformer steps done)] + the tensors its modules take,
in the order they take them. A fresh stream is all zeros. A step outputs the new value of
every state tensor except the rings (`TensorSpec.ring`), of which it outputs only the new
entries; `write_state` puts them in place: copying a whole ring in and out of every step would
move megabytes of keys and values for 2 new positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from moshi.modules.conv import StreamingConv1d, StreamingConvTranspose1d
from moshi.modules.seanet import SEANetResnetBlock
from moshi.modules.transformer import ProjectedTransformer, StreamingTransformerLayer

from ..core.contract import FRAME_SAMPLES
from ..core.seam import NUM_AGENT_CODEBOOKS


@dataclass(frozen=True)
class TensorSpec:
    """A step input or output: its name, shape after the batch dimension, and dtype. `ring`:
    for a state tensor that is a ring, its axis (after the batch dimension) of `shape[ring]`
    entries, each position in entry `position % shape[ring]`; the step outputs only its new
    entries along that axis, for positions offset, offset + 1, ..."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    ring: int | None = None


def write_state(state: list[torch.Tensor], rows, outputs: list[torch.Tensor], specs: list[TensorSpec]) -> None:
    """Write a step's state outputs (offset first) into `state`, the tensors it took them from
    (rows `rows` of each: a slice or an index tensor), in place: a ring's new entries at their
    positions, every other state whole."""
    offset = state[0][rows].clone()  # before the step: where the rings' new entries go
    index = torch.arange(state[0].shape[0], device=offset.device)[rows].view(-1, 1)
    positions: dict[tuple[int, int], torch.Tensor] = {}  # (ring size, new entries): shared by the rings
    for spec, tensor, new in zip(specs, state, outputs):
        if spec.ring is None:
            tensor[rows] = new
            continue
        axis = 1 + spec.ring
        key = (tensor.shape[axis], new.shape[axis])
        if key not in positions:
            positions[key] = torch.remainder(offset.view(-1, 1) + torch.arange(key[1], device=offset.device), key[0])
        # rows and positions first, as advanced indexing puts them: [B, new entries, ...]
        tensor.movedim(axis, 1)[index, positions[key]] = new.movedim(axis, 1).to(tensor)


def _weight_layout(module: nn.Module, layout: str) -> torch.Tensor:
    """A weight as the right-hand matrix of its product (see _causal_product, _conv_transpose,
    _weight_halves)."""
    if layout == "halves":
        return _weight_halves(module)
    w = module.weight.detach()
    if isinstance(module, nn.ConvTranspose1d):
        # as a conv of kernel 2 over the input, tap 0 on step t - 1 (the kernel's second half),
        # tap 1 on step t: [C_in, C_out / groups, 2 * s] -> [s, C_out / groups, C_in, 2]
        s = module.stride[0]
        w = w.view(w.shape[0], w.shape[1], 2, s).flip(2).permute(3, 1, 0, 2)
        if layout == "depthwise":  # [s, 1, C, 2] -> [2, s, C]
            return w[:, 0].permute(2, 0, 1).contiguous()
        w = w.reshape(-1, w.shape[2], 2)  # as a conv's weight: [(s, C_out), C_in, 2]
    c_out, c_in, k = w.shape
    if layout == "im2col":      # [C_out, C_in, k] -> [(k, C_in), C_out]
        return w.permute(2, 1, 0).reshape(k * c_in, c_out).contiguous()
    if layout == "taps":        # [C_out, C_in, taps * s] -> [(s, C_in), (taps, C_out)]
        s = module.stride[0] if isinstance(module, nn.Conv1d) else 1
        return w.permute(2, 1, 0).reshape(k // s, s, c_in, c_out).permute(1, 2, 0, 3).reshape(s * c_in, -1).contiguous()
    raise ValueError(layout)


class _Weights:
    """The weights of a step laid out for its matrix products (convs, attention's in-projection;
    see _weight_layout), made once, by the dry run at the step's construction, as buffers of
    the step (they move with it and export as constants; a step in PyTorch does not lay them
    out again every frame). Later steps only read them: Mimi's weights must not change after
    the step is made."""

    def __init__(self, step: nn.Module):
        self._step = step
        self._names: dict[tuple[nn.Module, str], str] = {}
        self.frozen = False

    def get(self, module: nn.Module, layout: str) -> torch.Tensor:
        name = self._names.get((module, layout))
        if name is None:
            if self.frozen:
                raise KeyError(f"no {layout} weights laid out for {module}")
            name = self._names[module, layout] = f"weights{len(self._names)}"
            self._step.register_buffer(name, _weight_layout(module, layout), persistent=False)
        return getattr(self._step, name)


class _StateIO:
    """Hands a step's incoming state tensors to the modules in order, collects the outgoing
    ones. With no incoming states it makes zeros instead, which is how a fresh state (and its
    specs) comes about: the order is the one the step itself uses. It also carries the step's
    laid-out weights."""

    def __init__(self, states: tuple[torch.Tensor, ...] | None, batch: int, like: torch.Tensor,
                 weights: _Weights):
        self._incoming = None if states is None else iter(states)
        self._batch, self._like = batch, like
        self.weights = weights
        self.taken: list[torch.Tensor] = []
        self.rings: list[int | None] = []  # of each state taken: its ring axis, if a ring
        self.given: list[torch.Tensor] = []

    def take(self, *shape: int, ring: int | None = None) -> torch.Tensor:
        """The next state tensor, [B, *shape]; `ring`: see TensorSpec (give its new entries)."""
        if self._incoming is None:
            state = self._like.new_zeros((self._batch, *shape))
        else:
            state = next(self._incoming)
        self.taken.append(state)
        self.rings.append(ring)
        return state

    def give(self, state: torch.Tensor) -> None:
        self.given.append(state)


def _causal_product(x: torch.Tensor, taps: int, step: int, weights: _Weights, module: nn.Module,
                    out_channels: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Output t = sum over i < taps of frame t + i times tap i of the kernel, for the frames of
    `step` samples of x ([B, L, C], time-major, the kept samples first), as one matrix product.
    Of the two ways to spread the taps over the product, it takes the one with the smaller
    intermediate: gathering each output's frames (im2col), or multiplying every frame by all
    the taps and summing shifted slices of the products. The bias is added in the product
    where it can be (im2col: one 2-D product and bias, a single Gemm in ONNX Runtime)."""
    B, L, C = x.shape
    frames = L // step
    length = frames - taps + 1
    x = x.reshape(B, frames, step * C)
    if length * taps * step * C <= frames * taps * out_channels:
        if taps > 1:
            x = torch.cat([x[:, i:i + length] for i in range(taps)], dim=-1)
        x = x.reshape(B * length, -1)
        weight = weights.get(module, "im2col")
        y = x @ weight if bias is None else torch.addmm(bias, x, weight)
        return y.view(B, length, out_channels)
    # rows (frame, tap) of the products: output t takes rows t * taps + i * (taps + 1), one
    # strided slice a tap (a single Slice in ONNX, no copy of the rows it skips)
    z = (x @ weights.get(module, "taps")).view(B, frames * taps, out_channels)
    y = sum(z[:, i * (taps + 1):i * (taps + 1) + (length - 1) * taps + 1:taps] for i in range(taps))
    return y if bias is None else y + bias


def _conv(conv: StreamingConv1d, x: torch.Tensor, io: _StateIO, first: torch.Tensor | None) -> torch.Tensor:
    """A causal conv, time-major [B, L, C], as one matrix product over frames of `stride`
    samples (ONNX Runtime's Conv ran the weight-heavy convs at a fraction of the memory
    bandwidth, and needed layout transposes around the transformer)."""
    inner = conv.conv.conv
    k, s = conv._effective_kernel_size, conv._stride
    if inner.padding[0] or inner.dilation[0] != 1 or inner.groups != 1 or k % s:
        raise TypeError("Mimi's convs: no padding, no dilation, not grouped, kernel a multiple of the stride")
    kept = k - s
    if kept:
        previous = io.take(kept, x.shape[2])
        if conv.pad_mode == "replicate":  # moshi primes a fresh buffer with the first sample
            previous = torch.where(first.view(-1, 1, 1), x[:, :1].expand_as(previous), previous)
        x = torch.cat([previous, x], dim=1)
        io.give(x[:, x.shape[1] - kept:])
    return _causal_product(x, k // s, s, io.weights, inner, inner.out_channels, inner.bias)


def _conv_transpose(convtr: StreamingConvTranspose1d, x: torch.Tensor, io: _StateIO) -> torch.Tensor:
    """A causal transposed conv, time-major [B, L, C]. With the kernel twice the stride (all of
    Mimi's), output block t (`stride` samples) is input step t times the kernel's first half
    plus step t - 1 times its second: a causal conv of kernel 2 over the input, with
    `stride * C_out` output channels (see _weight_layout), that keeps the last input step
    instead of moshi's overlapping output (`partial`), and needs no overlap-add."""
    inner = convtr.convtr.convtr
    s, c_out = inner.stride[0], inner.out_channels
    if inner.padding[0] or inner.dilation[0] != 1 or inner.output_padding[0] or inner.kernel_size[0] != 2 * s:
        raise TypeError("Mimi's transposed convs: no padding, no dilation, kernel twice the stride")
    B, L, _ = x.shape
    x = torch.cat([io.take(1, inner.in_channels), x], dim=1)
    io.give(x[:, L:])
    if inner.groups == 1:
        y = _causal_product(x, 2, 1, io.weights, inner, s * c_out, bias=None)
    elif inner.groups == inner.in_channels == c_out:
        halves = io.weights.get(inner, "depthwise")  # [2, s, C]: taps on step t - 1, step t
        y = x[:, :L, None, :] * halves[0] + x[:, 1:, None, :] * halves[1]
    else:
        raise TypeError("Mimi's transposed convs: plain or depthwise")
    y = y.reshape(B, L * s, c_out)
    return y if inner.bias is None else y + inner.bias


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


@dataclass(frozen=True)
class _Positions:
    """What every attention layer of a step shares: RoPE's rotation of the step's positions
    ([B, 1, T, D / 2] each) and the additive masks of what the queries see: of the ring's
    entries ([B, 1, 1, context]) and of the step's new keys ([T, T])."""

    cos: torch.Tensor
    sin: torch.Tensor
    ring_mask: torch.Tensor
    new_mask: torch.Tensor


def _positions(attn, offset: torch.Tensor, T: int, dtype: torch.dtype) -> _Positions:
    B, context, device = offset.shape[0], attn.context, offset.device
    D = attn.embed_dim // attn.num_heads
    # RoPE's angles as moshi's apply_rope computes them
    freqs = torch.exp(torch.arange(D // 2, device=device, dtype=torch.float32)
                      * (-math.log(attn.rope.max_period) * 2 / D))
    angles = freqs * (offset.float().view(-1, 1) + torch.arange(T, device=device, dtype=torch.float32)).view(B, 1, T, 1)
    # Ring slot i holds the newest position congruent to i before this step. moshi writes the
    # step's T keys first, displacing positions offset + t - context, then lets each query see
    # what the ring holds within `context` of it: the ring's positions from offset + T - context
    # on (all before every query), and the new keys causally.
    last = offset.view(B, 1) - 1
    pos_k = last - torch.remainder(last - torch.arange(context, device=device), context)  # [B, context]
    kept = (pos_k >= 0) & (pos_k >= offset.view(B, 1) + T - context)
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return _Positions(torch.cos(angles), torch.sin(angles), _additive(kept, dtype).view(B, 1, 1, context),
                      _additive(causal, dtype))


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))


def _rope(qk: torch.Tensor, positions: _Positions) -> torch.Tensor:
    """moshi's RoPE rotation, on queries and keys whose head dimensions are laid out as all real
    parts, then all imaginary parts (see _weight_halves)."""
    real, imag = qk.chunk(2, dim=-1)
    cos, sin = positions.cos, positions.sin
    return torch.cat([real * cos - imag * sin, real * sin + imag * cos], dim=-1)


def _weight_halves(attn) -> torch.Tensor:
    """The in-projection with each head's query and key dimensions reordered from moshi's
    interleaved (real, imaginary) pairs to halves, so that RoPE takes two slices of a head
    rather than a gather per part. Attention only takes dot products of a query with keys, which
    one reordering of both leaves as they are; the values keep their order."""
    H = attn.num_heads
    D = attn.embed_dim // H
    w = attn.in_projs[0].weight.detach().view(3, H, D, -1)
    halves = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)])
    return torch.cat([w[:2, :, halves.to(w.device)], w[2:]]).reshape(3 * H * D, -1).contiguous()


def _attention_layer(layer: StreamingTransformerLayer, x: torch.Tensor, positions: _Positions,
                     io: _StateIO) -> torch.Tensor:
    attn = layer.self_attn
    B, T, _ = x.shape
    H, context = attn.num_heads, attn.context
    D = attn.embed_dim // H
    weight = io.weights.get(attn, "halves") if attn.rope.interleave else attn.in_projs[0].weight
    qkv = F.linear(layer.norm1(x), weight).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
    q, k = _rope(qkv[:2], positions)
    v = qkv[2]

    # The keys and values of the last `context` positions, each in the ring slot of its
    # position (keys transposed, as the scores take them); the step's T new ones go in in
    # place of the oldest, after the step (write_state).
    keys, values = io.take(H, D, context, ring=2), io.take(H, context, D, ring=1)
    new_keys = k.transpose(2, 3)
    io.give(new_keys)
    io.give(v)
    q = q * D ** -0.5
    scores = torch.cat([torch.matmul(q, keys) + positions.ring_mask,
                        torch.matmul(q, new_keys) + positions.new_mask], dim=-1)
    weights = torch.softmax(scores, dim=-1)
    out = torch.matmul(weights[..., :context], values) + torch.matmul(weights[..., context:], v)
    x = x + layer.layer_scale_1(attn.out_projs[0](out.transpose(1, 2).reshape(B, T, H * D)))
    update = layer.linear2(layer.activation(layer.linear1(layer.norm2(x))))
    return x + layer.layer_scale_2(update)


def _transformer(projected: ProjectedTransformer, x: torch.Tensor, offset: torch.Tensor,
                 io: _StateIO) -> torch.Tensor:
    """[B, T, C] (time-major, as the steps' convs run) through Mimi's streaming transformer."""
    transformer = projected.transformer
    if transformer.positional_embedding != "rope" or not projected.conv_layout:
        raise TypeError("Mimi's transformer: RoPE positions, conv layout")
    attns = [layer.self_attn for layer in transformer.layers]
    if any(attn.kv_repeat != 1 or attn.weights_per_step or attn.context is None for attn in attns) or any(
            layer.gating is not None for layer in transformer.layers) or len(
            {(a.context, a.num_heads, a.embed_dim, a.rope.max_period) for a in attns}) != 1:
        raise TypeError("Mimi's transformer layers: alike, plain MHA with a context, ungated MLP")
    if projected.input_proj is not None:
        x = projected.input_proj(x)
    positions = _positions(attns[0], offset, x.shape[1], x.dtype)
    for layer in transformer.layers:
        x = _attention_layer(layer, x, positions, io)
    return projected.output_projs[0](x)


class MimiStep(nn.Module):
    """One 80 ms streaming step of half of Mimi: (input, offset, *state) -> (output, offset, *state)."""

    input: TensorSpec
    output: TensorSpec

    def __init__(self, mimi):
        super().__init__()
        self.mimi = mimi
        self._weights = _Weights(self)
        self.initial_state(1)  # the dry run lays out the weights
        self._weights.frozen = True

    def _step(self, x: torch.Tensor, offset: torch.Tensor, io: _StateIO) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, offset: torch.Tensor, *states: torch.Tensor):
        io = _StateIO(states, x.shape[0], self._like, self._weights)
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
    def _dry_run(self, batch: int) -> tuple[torch.Tensor, _StateIO]:
        """A step of fresh streams, which take zeroed states: (their offset, the step's io)."""
        like = self._like
        io = _StateIO(None, batch, like, self._weights)
        x = torch.zeros((batch, *self.input.shape), dtype=self.input.dtype, device=like.device)
        offset = torch.zeros(batch, dtype=torch.long, device=like.device)
        self._step(x, offset, io)
        return offset, io

    def initial_state(self, batch: int) -> list[torch.Tensor]:
        """A fresh stream: offset 0 and zeroed state tensors, on Mimi's device."""
        offset, io = self._dry_run(batch)
        return [offset, *io.taken]

    def specs(self) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """The state's specs (offset first) and the outputs' (the step's output first)."""
        offset, io = self._dry_run(1)
        states = [TensorSpec("offset", (), torch.long)] + [
            TensorSpec(f"state{i}", tuple(s.shape[1:]), s.dtype, ring)
            for i, (s, ring) in enumerate(zip(io.taken, io.rings))]
        outputs = [self.output] + [TensorSpec(f"{spec.name}_out", tuple(out.shape[1:]), out.dtype, spec.ring)
                                   for spec, out in zip(states, [offset, *io.given])]
        return states, outputs

    def state_specs(self) -> list[TensorSpec]:
        return self.specs()[0]


class MimiDecoderStep(MimiStep):
    """Agent codes [B, 8, 1] -> 24 kHz PCM [B, 1, 1920]."""

    input = TensorSpec("codes", (NUM_AGENT_CODEBOOKS, 1), torch.long)
    output = TensorSpec("pcm", (1, FRAME_SAMPLES), torch.float32)

    def _step(self, codes, offset, io):
        mimi = self.mimi
        emb = _conv_transpose(mimi.upsample.convtr, mimi.decode_latent(codes).transpose(1, 2), io)
        emb = _transformer(mimi.decoder_transformer, emb, offset, io)
        pcm = _seanet(mimi.decoder, emb, io)  # [B, 1920, 1]
        return pcm.reshape(pcm.shape[0], 1, -1)


class MimiEncoderStep(MimiStep):
    """24 kHz PCM [B, 1, 1920] -> codes [B, 8, 1]."""

    input = TensorSpec("pcm", (1, FRAME_SAMPLES), torch.float32)
    output = TensorSpec("codes", (NUM_AGENT_CODEBOOKS, 1), torch.long)

    def _step(self, pcm, offset, io):
        mimi = self.mimi
        emb = _seanet(mimi.encoder, pcm.reshape(pcm.shape[0], -1, 1), io)
        emb = _transformer(mimi.encoder_transformer, emb, offset, io)
        emb = _conv(mimi.downsample.conv, emb, io, first=offset == 0)
        return mimi.quantizer.encode(emb.transpose(1, 2))


STEPS = {"decoder": MimiDecoderStep, "encoder": MimiEncoderStep}
