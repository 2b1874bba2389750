"""PersonaPlex's generation step on moshi's `LMModel`, for a pool of conversation slots.

PyPI moshi's `LMGen` cannot run PersonaPlex (with 16 depformer codebooks it ignores the user's
audio and it cannot force prompt tokens), so this module keeps PersonaPlex's own token grid:
per slot a ring buffer `cache[17, max_delay + 3]` of tokens (row 0 text, 1..8 agent audio,
9..16 user audio) with `provided` flags for forced tokens. A call at position `o` writes the
forced tokens at `o + delay`, runs the temporal transformer on the tokens of position `o - 1`,
samples the text token and the 16 depformer codebooks of position `o` (forced ones replace the
samples as depformer inputs) and, once past the delays, returns position `o - 1` with every
stream aligned: text, agent cb0..7 (ready for the Mimi decoder) and the user's echo.

Every slot keeps its own position, so slots join, idle and leave independently: rows outside
`active` are left untouched (moshi's exec mask keeps their transformer state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from moshi.utils.compile import CUDAGraphed

from .sampling import SamplingParams, SlotSampling, sample

NUM_AUDIO = 8  # codebooks per audio stream


@dataclass
class StepInputs:
    """What is forced at one step, per slot: [S] masks, [S, 8] codes, [S] text tokens."""

    active: torch.Tensor
    user_codes: torch.Tensor
    agent_codes: torch.Tensor
    agent_forced: torch.Tensor
    text_token: torch.Tensor
    text_forced: torch.Tensor
    embeddings: torch.Tensor | None = None  # [S, 1, dim], replaces the token embeddings where embed_rows
    embed_rows: torch.Tensor | None = None


def _batch_tensors(state, batch_size: int):
    """(name, tensor) of a moshi streaming state's per-row tensors (batch dim first)."""
    for name, value in vars(state).items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch_size:
            yield name, value


class SlotGenerator:
    """The token grids of `num_slots` conversations over one streaming `LMModel`."""

    def __init__(self, lm, num_slots: int, cuda_graphs: bool = True):
        self.lm = lm
        self.num_slots = num_slots
        device = lm.device
        self.device = device
        self.delays = torch.tensor(lm.delays, dtype=torch.long, device=device)
        self.max_delay = int(max(lm.delays))
        self.ring = self.max_delay + 3
        K = lm.num_codebooks  # 17
        self.num_codebooks = K
        self.cache = torch.full((num_slots, K, self.ring), lm.ungenerated_token_id, dtype=torch.long, device=device)
        self.provided = torch.zeros((num_slots, K, self.ring), dtype=torch.bool, device=device)
        self.offset = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.initial = lm._get_initial_token()[0, :, 0]  # [17]
        self.sampling = SlotSampling(num_slots, device)
        self.max_top_k = 1
        self.max_top_k_text = 1
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        self._graphs: dict[tuple[int, int], CUDAGraphed] = {}
        self._streaming = lm.streaming(num_slots)
        self._streaming.__enter__()

    def close(self) -> None:
        self._streaming.__exit__(None, None, None)

    # -- slot life cycle -------------------------------------------------------------------
    def start(self, slot: int, params: SamplingParams) -> None:
        """Fresh state for `slot`, at position 1: position 0 holds the initial tokens.

        This is PersonaPlex's first call, which never runs the model: whatever a sequence's
        first frame forces is overwritten by the initial tokens.
        """
        mask = torch.zeros(self.num_slots, dtype=torch.bool, device=self.device)
        mask[slot] = True
        self.lm.reset_streaming(mask)
        self.cache[slot] = self.lm.ungenerated_token_id
        self.provided[slot] = False
        self.cache[slot, :, 0] = self.initial
        self.provided[slot, :, 0] = True
        self.offset[slot] = 1
        self.sampling.set(slot, params)
        self.max_top_k = max(int(self.sampling.top_k.max()), 1)
        self.max_top_k_text = max(int(self.sampling.top_k_text.max()), 1)

    def snapshot(self, slot: int) -> dict:
        """A copy of everything `slot` has accumulated: its token grid and the temporal
        transformer's streaming state (KV cache up to its length, offsets)."""
        snap = {"cache": self.cache[slot].clone(), "provided": self.provided[slot].clone(),
                "offset": self.offset[slot].clone(), "modules": []}
        for state in self._transformer_states():
            rows = {name: value[slot].clone() for name, value in _batch_tensors(state, self.num_slots)}
            kv = getattr(state, "kv_cache", None)
            if kv is not None:
                length = min(int(kv.end_offset[slot]), kv.capacity)
                rows["kv"] = kv.cache[:, slot, :, :length].clone()
                rows["kv_end_offset"] = kv.end_offset[slot].clone()
            snap["modules"].append(rows)
        return snap

    def restore(self, slot: int, snap: dict) -> None:
        """Put a snapshot (of any slot) into `slot`."""
        self.cache[slot] = snap["cache"]
        self.provided[slot] = snap["provided"]
        self.offset[slot] = snap["offset"]
        for state, rows in zip(self._transformer_states(), snap["modules"], strict=True):
            for name, value in _batch_tensors(state, self.num_slots):
                value[slot] = rows[name]
            if "kv" in rows:
                kv = state.kv_cache
                kv.cache[:, slot, :, :rows["kv"].shape[2]] = rows["kv"]
                kv.end_offset[slot] = rows["kv_end_offset"]

    def _transformer_states(self):
        for module in self.lm.transformer.modules():
            state = getattr(module, "_streaming_state", None)
            if state is not None:
                yield state

    def restore_cache(self, slot: int, cache: torch.Tensor) -> None:
        """Set a slot's token ring buffer, as a voice-prompt bundle does after its replay."""
        self.cache[slot] = cache.to(self.cache)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Summed input embeddings of one position's tokens [S, 17] -> [S, 1, dim]."""
        lm = self.lm
        x = lm.emb[0](tokens[:, 1:2])
        for cb in range(1, lm.num_audio_codebooks):  # PersonaPlex's summation order
            x = x + lm.emb[cb](tokens[:, cb + 1:cb + 2])
        return x + lm.text_emb(tokens[:, 0:1])

    # -- one batched step ------------------------------------------------------------------
    @torch.no_grad()
    def step(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Advance every active slot by one position.

        Returns (tokens [S, 17] of position o - 1, has_output [S], input embeddings [S, 1, dim]);
        rows without output (inactive, or still inside the delays) hold garbage.
        """
        lm, S, K, CT = self.lm, self.num_slots, self.num_codebooks, self.ring
        active = inputs.active
        rows = torch.arange(S, device=self.device)
        o = self.offset

        # 1. forced tokens land at o + delay.
        forced = torch.zeros((S, K), dtype=torch.long, device=self.device)
        forced[:, 0] = inputs.text_token
        forced[:, 1:1 + NUM_AUDIO] = inputs.agent_codes
        forced[:, 1 + NUM_AUDIO:] = inputs.user_codes
        is_forced = torch.zeros((S, K), dtype=torch.bool, device=self.device)
        is_forced[:, 0] = inputs.text_forced
        is_forced[:, 1:1 + NUM_AUDIO] = inputs.agent_forced[:, None]
        is_forced[:, 1 + NUM_AUDIO:] = True
        is_forced &= active[:, None]
        write = (o[:, None] + self.delays[None, :]) % CT  # [S, K]
        self._scatter(write, forced, is_forced)
        # 2. the delayed streams start from the initial token.
        at_start = (o[:, None] <= self.delays[None, :]) & active[:, None]
        self._scatter((o % CT)[:, None].expand(S, K), self.initial[None, :].expand(S, K), at_start)

        # 3. the transformer reads position o - 1 and predicts position o.
        src = ((o - 1) % CT)[:, None, None].expand(S, K, 1)
        dst = (o % CT)[:, None, None].expand(S, K, 1)
        model_input = self.cache.gather(2, src)[:, :, 0]
        target = self.cache.gather(2, dst)[:, :, 0]
        target_provided = self.provided.gather(2, dst)[:, :, 0]

        emb = self.embed(model_input)
        if inputs.embeddings is not None:
            emb = torch.where(inputs.embed_rows[:, None, None], inputs.embeddings.to(emb), emb)
        lm.set_exec_mask(active)
        sampled = self._graphed_model_step()(emb, target, target_provided, o)

        # 4. samples fill position o where nothing was forced; o - 1 is done.
        self._scatter(dst[:, :, 0], sampled, ~(target_provided | ~active[:, None]))
        clear = ((o - 1) % CT)[:, None].expand(S, K)
        self.provided[rows[:, None], torch.arange(K, device=self.device)[None, :], clear] &= ~active[:, None]

        has_output = active & (o > self.max_delay)
        out_pos = (o[:, None] - self.max_delay + self.delays[None, :]) % CT
        tokens = self.cache.gather(2, out_pos[:, :, None])[:, :, 0]
        self.offset = torch.where(active, o + 1, o)
        return tokens, has_output, emb

    def _graphed_model_step(self) -> CUDAGraphed:
        """The model's part of a step, under a CUDA graph on GPUs (eager PyTorch is
        launch-bound there); one graph per top-k bound, as those set the shapes."""
        key = (self.max_top_k_text, self.max_top_k)
        if key not in self._graphs:
            self._graphs[key] = CUDAGraphed(self._model_step, disable=not self.cuda_graphs)
        return self._graphs[key]

    def _model_step(self, emb, target, target_provided, step):
        """Temporal transformer on the input embeddings [S, 1, dim], then the text token and
        the 16 depformer codebooks: [S, 17] sampled tokens of position `step`."""
        lm, smp = self.lm, self.sampling
        transformer_out = lm.transformer(emb)
        if lm.out_norm:
            transformer_out = lm.out_norm(transformer_out)
        text_logits = lm.text_linear(transformer_out)[:, 0]
        text = sample(text_logits, smp.greedy, smp.temperature_text, smp.top_k_text,
                      smp.seed, step, 0, self.max_top_k_text)
        first = torch.where(target_provided[:, 0], target[:, 0], text)
        audio = self._depformer(transformer_out, first, target[:, 1:], target_provided[:, 1:], step)
        return torch.cat([text[:, None], audio], dim=1)

    def _depformer(self, transformer_out, first_input, forced, forced_mask, step):
        lm, smp = self.lm, self.sampling
        tokens = []
        prev = first_input
        with lm.depformer.streaming(self.num_slots):
            for cb in range(lm.dep_q):
                logits = lm.forward_depformer(cb, prev[:, None, None], transformer_out)[:, 0, 0]
                token = sample(logits, smp.greedy, smp.temperature, smp.top_k,
                               smp.seed, step, 1 + cb, self.max_top_k)
                tokens.append(token)
                prev = torch.where(forced_mask[:, cb], forced[:, cb], token)
        return torch.stack(tokens, dim=1)

    def _scatter(self, positions: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
        """cache[s, k, positions[s, k]] = values[s, k] and provided = True, where mask[s, k]."""
        idx = positions[:, :, None]
        current = self.cache.gather(2, idx)[:, :, 0]
        self.cache.scatter_(2, idx, torch.where(mask, values, current)[:, :, None])
        was = self.provided.gather(2, idx)[:, :, 0]
        self.provided.scatter_(2, idx, (was | mask)[:, :, None])
