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

A step runs on the first `b` slots only, `b` a batch bucket (1, 2, 4, ... up to the pool): the
streaming state of every module is viewed as its first `b` rows, so a tick of 3 conversations
in slots 0..2 pays for 4 rows, not for the whole pool. Under CUDA graphs there is one graph per
(batch bucket, top-k bucket), all captured by `capture_graphs()` when the model loads: nothing a
client sends makes the server capture another.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from moshi.utils.compile import CUDAGraphed
from torch.nn import functional as F

from . import loaders
from .sampling import SamplingParams, SlotSampling, exponential_noise, sample

NUM_AUDIO = 8  # codebooks per audio stream
PREFILL_CHUNK = 256  # prefill positions per transformer pass


def batch_buckets(num_slots: int) -> tuple[int, ...]:
    """The batch sizes a step runs at: powers of two below the pool, then the pool."""
    sizes = [1 << i for i in range(num_slots.bit_length()) if 1 << i < num_slots]
    return (*sizes, num_slots)


def bucket_for(value: int, buckets) -> int:
    """The smallest bucket >= value."""
    for bucket in buckets:
        if bucket >= value:
            return bucket
    raise ValueError(f"{value} is above the largest bucket {buckets[-1]}")


@dataclass
class StepInputs:
    """What is forced at one step, for the first b slots (b a batch bucket): [b] masks,
    [b, 8] codes, [b] text tokens."""

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


def _rows_view(state, num_slots: int, rows: slice):
    """A moshi streaming state whose tensors are views of some rows of `state`'s, so a module
    stepped on it reads and writes the pool's own memory."""
    view = copy.copy(state)
    view.batch_size = rows.stop - rows.start
    for name, value in _batch_tensors(state, num_slots):
        setattr(view, name, value[rows])
    kv = getattr(state, "kv_cache", None)
    if kv is not None:  # moshi's RingKVCache: cache [2, B, heads, capacity, dim], end_offset [B]
        kv_view = copy.copy(kv)
        kv_view.cache = kv.cache[:, rows]
        kv_view.end_offset = kv.end_offset[rows]
        view.kv_cache = kv_view
    return view


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
        self.top_k_bound = loaders.TOP_K_BUCKETS[0]
        self.top_k_text_bound = loaders.TOP_K_TEXT_BUCKETS[0]
        self.buckets = batch_buckets(num_slots)
        self.cuda_graphs = cuda_graphs and device.type == "cuda"
        self._graphs: dict[tuple[int, int, int], CUDAGraphed] = {}
        self._streaming = lm.streaming(num_slots)
        self._streaming.__enter__()
        modules = [m for m in lm.transformer.modules() if getattr(m, "_streaming_state", None) is not None]
        self._row_views = {b: [(m, _rows_view(m._streaming_state, num_slots, slice(0, b))) for m in modules]
                           for b in self.buckets}
        self._full_states = [(m, m._streaming_state) for m in modules]

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
        # Graphs are keyed by fixed top-k buckets, never by a client's value.
        self.top_k_bound = bucket_for(max(int(self.sampling.top_k.max()), 1), loaders.TOP_K_BUCKETS)
        self.top_k_text_bound = bucket_for(max(int(self.sampling.top_k_text.max()), 1), loaders.TOP_K_TEXT_BUCKETS)

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
    def capture_graphs(self) -> int:
        """Capture every graph serving can use (each batch bucket x top-k bucket) by running a
        step with no slot active, which leaves every slot's state as it was. Returns how many."""
        if not self.cuda_graphs:
            return 0
        bounds = (self.top_k_text_bound, self.top_k_bound)
        for b in self.buckets:
            idle = self._idle_inputs(b)
            for self.top_k_text_bound in loaders.TOP_K_TEXT_BUCKETS:
                for self.top_k_bound in loaders.TOP_K_BUCKETS:
                    for _ in range(2):  # moshi's CUDAGraphed: a warm-up call, then the capture
                        self.step(idle)
        self.top_k_text_bound, self.top_k_bound = bounds
        return len(self._graphs)

    @torch.no_grad()
    def step(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Advance every active slot among the first b by one position (b = the inputs' rows,
        a batch bucket).

        Returns (tokens [b, 17] of position o - 1, has_output [b], input embeddings [b, 1, dim]);
        rows without output (inactive, or still inside the delays) hold garbage.
        """
        b = inputs.active.shape[0]
        if b not in self._row_views:
            raise ValueError(f"a step runs on a batch bucket {self.buckets}, not on {b} rows")
        rows = slice(0, b)
        o = self.offset[rows].clone()
        emb, target, target_provided = self._read_position(rows, o, inputs)
        exec_mask = torch.zeros(self.num_slots, dtype=torch.bool, device=self.device)
        exec_mask[rows] = inputs.active
        self.lm.set_exec_mask(exec_mask)
        with self._rows(self._row_views[b]):
            sampled = self._graphed_model_step(b)(emb, target, target_provided, o)
        tokens, has_output = self._write_position(rows, o, inputs.active, sampled, target_provided)
        return tokens, has_output, emb

    @torch.no_grad()
    def prefill(self, slot: int, steps: list) -> torch.Tensor:
        """Play a persona's prefill into a freshly started `slot` at once: every token of a
        prefill step is forced, so its samples are never used and the depformer need not run;
        the temporal transformer takes all the steps' input embeddings in chunked passes, as
        an LLM takes a prompt. `steps`: (StepInputs of one row, every stream forced; a ring
        buffer to restore after the step, or None). Returns the input embeddings [M, 1, dim]."""
        rows = slice(slot, slot + 1)
        embeddings = []
        for inputs, restore_cache in steps:
            o = self.offset[rows].clone()
            emb, target, target_provided = self._read_position(rows, o, inputs)
            if not bool(target_provided.all()):
                raise ValueError("a prefill step must force every stream")
            self._write_position(rows, o, inputs.active, target, target_provided)
            if restore_cache is not None:
                self.restore_cache(slot, restore_cache)
            embeddings.append(emb)
        if not embeddings:
            return torch.zeros(0, 1, self.lm.dim, device=self.device)
        sequence = torch.cat(embeddings, dim=1)  # [1, M, dim]
        exec_mask = torch.zeros(self.num_slots, dtype=torch.bool, device=self.device)
        exec_mask[slot] = True
        self.lm.set_exec_mask(exec_mask)
        views = [(m, _rows_view(state, self.num_slots, rows)) for m, state in self._full_states]
        with self._rows(views):
            for chunk in sequence.split(PREFILL_CHUNK, dim=1):
                self.lm.transformer(chunk)
        return sequence.transpose(0, 1)

    def _read_position(self, rows: slice, o: torch.Tensor, inputs: StepInputs):
        """Write the forced tokens of a step at o + delay (the delayed streams start from the
        initial token) and read position o - 1 for the transformer and position o, which it
        predicts: (input embeddings [b, 1, dim], target [b, K], target provided [b, K])."""
        K, CT = self.num_codebooks, self.ring
        cache, provided, active = self.cache[rows], self.provided[rows], inputs.active
        b = active.shape[0]
        forced = torch.zeros((b, K), dtype=torch.long, device=self.device)
        forced[:, 0] = inputs.text_token
        forced[:, 1:1 + NUM_AUDIO] = inputs.agent_codes
        forced[:, 1 + NUM_AUDIO:] = inputs.user_codes
        is_forced = torch.zeros((b, K), dtype=torch.bool, device=self.device)
        is_forced[:, 0] = inputs.text_forced
        is_forced[:, 1:1 + NUM_AUDIO] = inputs.agent_forced[:, None]
        is_forced[:, 1 + NUM_AUDIO:] = True
        is_forced &= active[:, None]
        write = (o[:, None] + self.delays[None, :]) % CT  # [b, K]
        _scatter(cache, provided, write, forced, is_forced)
        at_start = (o[:, None] <= self.delays[None, :]) & active[:, None]
        _scatter(cache, provided, (o % CT)[:, None].expand(b, K), self.initial[None, :].expand(b, K), at_start)

        src = ((o - 1) % CT)[:, None, None].expand(b, K, 1)
        dst = (o % CT)[:, None, None].expand(b, K, 1)
        emb = self.embed(cache.gather(2, src)[:, :, 0])
        if inputs.embeddings is not None:
            emb = torch.where(inputs.embed_rows[:, None, None], inputs.embeddings.to(emb), emb)
        return emb, cache.gather(2, dst)[:, :, 0], provided.gather(2, dst)[:, :, 0]

    def _write_position(self, rows: slice, o, active, sampled, target_provided):
        """Samples fill position o where nothing was forced; o - 1 is done; active rows move on.
        Returns (tokens [b, 17] of position o - 1, has_output [b])."""
        K, CT = self.num_codebooks, self.ring
        cache, provided = self.cache[rows], self.provided[rows]
        b = active.shape[0]
        dst = (o % CT)[:, None].expand(b, K)
        _scatter(cache, provided, dst, sampled, ~(target_provided | ~active[:, None]))
        clear = ((o - 1) % CT)[:, None].expand(b, K)
        index = torch.arange(b, device=self.device)[:, None], torch.arange(K, device=self.device)[None, :], clear
        provided[index] &= ~active[:, None]
        has_output = active & (o > self.max_delay)
        out_pos = (o[:, None] - self.max_delay + self.delays[None, :]) % CT
        tokens = cache.gather(2, out_pos[:, :, None])[:, :, 0]
        self.offset[rows] = torch.where(active, o + 1, o)
        return tokens, has_output

    def _idle_inputs(self, b: int) -> StepInputs:
        """A step of b rows with none active: it changes no slot's state."""
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=self.device)
        return StepInputs(active=zeros(b, dtype=torch.bool), user_codes=zeros(b, NUM_AUDIO),
                          agent_codes=zeros(b, NUM_AUDIO), agent_forced=zeros(b, dtype=torch.bool),
                          text_token=zeros(b), text_forced=zeros(b, dtype=torch.bool))

    @contextmanager
    def _rows(self, views):
        """The transformer's modules see only some rows of their streaming state."""
        for module, view in views:
            module._streaming_state = view
        try:
            yield
        finally:
            for module, state in self._full_states:
                module._streaming_state = state

    def _graphed_model_step(self, b: int) -> CUDAGraphed:
        """The model's part of a step, under a CUDA graph on GPUs (eager PyTorch is
        launch-bound there); one graph per batch bucket and top-k bucket, as those set the shapes."""
        key = (b, self.top_k_text_bound, self.top_k_bound)
        if key not in self._graphs:
            self._graphs[key] = CUDAGraphed(self._model_step, disable=not self.cuda_graphs)
        return self._graphs[key]

    def _model_step(self, emb, target, target_provided, step):
        """Temporal transformer on the input embeddings [S, 1, dim], then the text token and
        the 16 depformer codebooks: [S, 17] sampled tokens of position `step`."""
        lm, smp = self.lm, self.sampling.rows(emb.shape[0])
        noise = exponential_noise(smp.seed, step, self.num_codebooks, max(self.top_k_text_bound, self.top_k_bound))
        transformer_out = lm.transformer(emb)
        if lm.out_norm:
            transformer_out = lm.out_norm(transformer_out)
        text_logits = lm.text_linear(transformer_out)[:, 0]
        text = sample(text_logits, smp.greedy, smp.temperature_text, smp.top_k_text, noise[:, 0],
                      self.top_k_text_bound)
        first = torch.where(target_provided[:, 0], target[:, 0], text)
        audio = self._depformer(transformer_out, first, target[:, 1:], target_provided[:, 1:], noise[:, 1:])
        return torch.cat([text[:, None], audio], dim=1)

    def _depformer(self, transformer_out, first_input, forced, forced_mask, noise):
        """The depformer over the 16 codebooks of one position, on moshi's modules and weights
        (`LMModel.forward_depformer` in a fresh `depformer.streaming`), with its streaming
        bookkeeping written out: each layer's keys and values of the codebooks so far sit in
        one buffer that attention reads up to the current codebook, where moshi keeps a ring
        KV cache, per-row offsets and a mask for each layer and call (most of a CPU step's
        time at small widths)."""
        lm, smp = self.lm, self.sampling.rows(first_input.shape[0])
        b, steps = first_input.shape[0], lm.dep_q
        layers = lm.depformer.layers
        heads = layers[0].self_attn.num_heads
        head_dim = layers[0].self_attn.embed_dim // heads
        kv = transformer_out.new_empty((len(layers), 2, b, heads, steps, head_dim))
        tokens = []
        prev = first_input
        for cb in range(steps):
            token_emb = lm.depformer_text_emb if cb == 0 else lm.depformer_emb[cb - 1]
            x = lm.depformer_in[cb](transformer_out) + token_emb(prev[:, None])
            for layer, (keys, values) in zip(layers, kv):
                attn = layer.self_attn
                q, k, v = attn.in_projs[cb](layer.norm1(x)).view(b, 1, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
                keys[:, :, cb:cb + 1] = k
                values[:, :, cb:cb + 1] = v
                out = F.scaled_dot_product_attention(q, keys[:, :, :cb + 1], values[:, :, :cb + 1])
                x = x + attn.out_projs[cb](out.transpose(1, 2).reshape(b, 1, heads * head_dim))
                x = x + layer.gating[cb](layer.norm2(x))
            logits = lm.linears[cb](lm.depformer_norms[cb](x))[:, 0]
            token = sample(logits, smp.greedy, smp.temperature, smp.top_k, noise[:, cb], self.top_k_bound)
            tokens.append(token)
            prev = torch.where(forced_mask[:, cb], forced[:, cb], token)
        return torch.stack(tokens, dim=1)


def _scatter(cache: torch.Tensor, provided: torch.Tensor, positions: torch.Tensor, values: torch.Tensor,
             mask: torch.Tensor) -> None:
    """cache[s, k, positions[s, k]] = values[s, k] and provided = True, where mask[s, k]."""
    idx = positions[:, :, None]
    current = cache.gather(2, idx)[:, :, 0]
    cache.scatter_(2, idx, torch.where(mask, values, current)[:, :, None])
    was = provided.gather(2, idx)[:, :, 0]
    provided.scatter_(2, idx, (was | mask)[:, :, None])
