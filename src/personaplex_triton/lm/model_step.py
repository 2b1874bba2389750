"""The model's part of a generation step, for the b rows a step carries: PersonaPlex's temporal
transformer on a position's input embeddings, the text token, then the depformer over the agent's
8 codebooks, each sampled per conversation (sampling.py). It runs inside the step's CUDA graph
(generation.py, step_graphs.py): fixed shapes, no host syncs.

The depformer is moshi's modules and weights (`LMModel.forward_depformer` in a fresh
`depformer.streaming`) with its streaming bookkeeping written out: each layer's keys and values
of the codebooks so far sit in one buffer that attention reads up to the current codebook, where
moshi keeps a ring KV cache, per-row offsets and a mask for each layer and call (most of a CPU
step's time at small widths). Only the agent's codebooks run: the user's audio is forced at every
step (or written right after it, `SlotGenerator.force_user`), so the samples of the last 8
codebooks would be replaced by the user's codes, and no earlier codebook attends to them.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .sampling import Sampler, SlotSampling, exponential_noise, sample
from .token_grid import NUM_AUDIO


class ModelStep:
    def __init__(self, lm):
        self.lm = lm

    def __call__(self, emb, target, target_provided, step, smp: SlotSampling, top_k_text_bound: int,
                 top_k_bound: int):
        """Temporal transformer on the input embeddings [b, 1, dim], then the text token and
        the depformer: [b, 17] tokens of position `step` (text, the agent's 8 codebooks
        sampled with the rows' settings `smp`, the user's 8 as forced). `target` [b, 17] with
        `target_provided`: what is forced there, which replaces the samples as the depformer's
        inputs. The top-k bounds: how many columns the sampling's top-k keeps (a graph's shapes)."""
        lm = self.lm
        # channels: the text token and the agent's codebooks, the only ones sampled (a channel's
        # draws do not depend on how many are drawn)
        noise = exponential_noise(smp.seed, step, 1 + NUM_AUDIO, max(top_k_text_bound, top_k_bound))
        transformer_out = lm.transformer(emb)
        if lm.out_norm:
            transformer_out = lm.out_norm(transformer_out)
        text_logits = lm.text_linear(transformer_out)[:, 0]
        text = sample(text_logits, smp.greedy, smp.temperature_text, smp.top_k_text, noise[:, 0], top_k_text_bound)
        first = torch.where(target_provided[:, 0], target[:, 0], text)
        audio = self.depformer(transformer_out, first, target[:, 1:], target_provided[:, 1:], noise[:, 1:],
                               smp, top_k_bound)
        return torch.cat([text[:, None], audio], dim=1)

    def depformer(self, transformer_out, first_input, forced, forced_mask, noise, smp: SlotSampling,
                  top_k_bound: int):
        """The depformer over the agent's codebooks of one position (the module docstring):
        [b, 16] tokens, the user's columns holding `forced`. The projections are called as
        `F.linear` on their modules' weights, and the first codebook's attention, over its one
        key, is its value (a softmax of one score is exactly 1): on a CPU every op's dispatch
        counts."""
        lm = self.lm
        b, steps = first_input.shape[0], lm.dep_q - NUM_AUDIO
        layers = lm.depformer.layers
        heads = layers[0].self_attn.num_heads
        head_dim = layers[0].self_attn.embed_dim // heads
        kv = transformer_out.new_empty((len(layers), 2, b, heads, steps, head_dim))
        sample_audio = Sampler(smp.greedy, smp.temperature, smp.top_k, top_k_bound, lm.card)
        tokens = []
        prev = first_input
        for cb in range(steps):
            token_emb = lm.depformer_text_emb if cb == 0 else lm.depformer_emb[cb - 1]
            x = _linear(lm.depformer_in[cb], transformer_out) + token_emb(prev[:, None])
            for layer, (keys, values) in zip(layers, kv):
                attn = layer.self_attn
                q, k, v = _linear(attn.in_projs[cb], layer.norm1(x)).view(b, 1, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
                keys[:, :, cb:cb + 1] = k
                values[:, :, cb:cb + 1] = v
                out = v if cb == 0 else F.scaled_dot_product_attention(q, keys[:, :, :cb + 1], values[:, :, :cb + 1])
                x = x + _linear(attn.out_projs[cb], out.transpose(1, 2).reshape(b, 1, heads * head_dim))
                x = x + layer.gating[cb](layer.norm2(x))
            logits = _linear(lm.linears[cb], lm.depformer_norms[cb](x))[:, 0]
            token = sample_audio(logits, noise[:, cb])
            tokens.append(token)
            if cb + 1 < steps:
                prev = torch.where(forced_mask[:, cb], forced[:, cb], token)
        return torch.cat([torch.stack(tokens, dim=1), forced[:, steps:]], dim=1)


def _linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`, for a plain linear layer without the module call's overhead."""
    if type(module) is not torch.nn.Linear:  # fp8_weights.Fp8Linear
        return module(x)
    return F.linear(x, module.weight, module.bias)
