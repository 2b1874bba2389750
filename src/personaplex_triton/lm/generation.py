"""PersonaPlex's generation step on moshi's `LMModel`, for a pool of conversation slots.

PyPI moshi's `LMGen` cannot run PersonaPlex (with 16 depformer codebooks it ignores the user's
audio and it cannot force prompt tokens), so this module keeps PersonaPlex's own token grid
(token_grid.py). A call at position `o` writes the forced tokens, runs the model on the tokens
of position `o - 1` (model_step.py: the temporal transformer, then the text token and the
agent's 8 depformer codebooks of position `o`, forced ones replacing the samples as depformer
inputs) and, once past the delays, returns a position with every stream aligned: text, agent
cb0..7 (ready for the Mimi decoder) and the user's echo.

Every slot keeps its own position, so slots join, idle and leave independently: rows outside
`active` are left untouched (moshi's exec mask keeps their transformer state).

A step carries the slots with a frame, packed into `b` rows (`b` a batch bucket under CUDA
graphs, buckets.py) through a slot table, `StepInputs.rows`: the token grid, the sampling
settings and the modules' small streaming state are gathered for those rows and written back,
and the attention kernel reads each row's KV cache in the pool where it lies (slot_states.py),
so a tick costs what it carries, wherever its slots sit. On GPUs the step runs under CUDA
graphs (step_graphs.py), one per bucket, the slot table an input. On CUDA, a one-frame step's attention reads only the KV entries
each slot has written (ring_attention.py), and each RMS norm and gating activation is one
kernel (fused_ops.py); moshi's modules are the reference. The KV cache holds the model's dtype,
or float8_e4m3fn (kv_cache.py). A persona's prefill is played into a slot apart (prefill.py).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ..core import tunables
from ..core.buckets import batch_buckets, bucket_for
from ..core.host_copies import to_device
from . import fused_ops, kv_cache, ring_attention
from .model_step import ModelStep
from .prefill_graphs import PrefillPasses
from .sampling import SamplingParams, SlotSampling
from .slot_states import SlotStates
from .step_graphs import GraphedCall, StepGraphs
from .step_inputs import ACTIVE, HAS_OUTPUT, SLOT, STREAMS, USER, StepInputs, unpack
from .token_grid import TokenGrid

__all__ = ["SlotGenerator", "StepInputs"]


class SlotGenerator:
    """The token grids of `num_slots` conversations over one streaming `LMModel`."""

    def __init__(self, lm, num_slots: int, cuda_graphs: bool = True, ring: bool = True,
                 kv_dtype: torch.dtype | None = None):
        """`ring`: on CUDA, steps run the project's kernels, ring_attention.py and fused_ops.py;
        on a CPU, attention reads the ring up to its last entry written (kv_cache.FilledRingKVCache)
        (else moshi's modules, the reference).
        `kv_dtype`: what the temporal transformer's KV cache stores (None: the model's dtype)."""
        self.lm = lm
        self.num_slots = num_slots
        device = lm.device
        self.device = device
        self.grid = TokenGrid(num_slots, lm.delays, lm._get_initial_token()[0, :, 0], lm.ungenerated_token_id, device)
        self.sampling = SlotSampling(num_slots, device)
        self.model_step = ModelStep(lm)
        self.top_k_bound = tunables.TOP_K_BUCKETS[0]
        self.top_k_text_bound = tunables.TOP_K_TEXT_BUCKETS[0]
        self.buckets = batch_buckets(num_slots)
        self.ring_attention = ring and ring_attention.available(device)
        if self.ring_attention:
            ring_attention.install(lm.transformer)
            fused_ops.install(lm)
        else:
            ring_attention.uninstall(lm.transformer)
            fused_ops.uninstall(lm)
        self.kv_dtype = kv_dtype or next(lm.parameters()).dtype
        kv_cache.store_in(lm.transformer, self.kv_dtype, lm.text_emb.weight.dtype)
        self.graphs = StepGraphs(self._step, cuda_graphs and device.type == "cuda", self._no_embeddings)
        self._unembedded: dict[int, torch.Tensor] = {}
        self._streaming = lm.streaming(num_slots)
        self._streaming.__enter__()
        if ring and device.type == "cpu":
            kv_cache.read_filled(lm.transformer)
        self.states = SlotStates(lm.transformer, num_slots, indexed_kv=self.ring_attention)
        self.prefill = PrefillPasses(lm, self.states, self.graphs.enabled)
        # A start's model reset and its prefill's embeddings run between the live ticks: eager
        # they are hundreds of launches (moshi's reset walks every module; each embedding's
        # lookup is several kernels), under graphs one each.
        self._reset = GraphedCall(lm.reset_streaming, (torch.zeros(num_slots, dtype=torch.bool, device=device),),
                                  self.graphs.enabled)
        self._embed_prefill = GraphedCall(
            self.embed, (torch.zeros(tunables.MAX_PREFILL_POSITIONS, STREAMS, dtype=torch.long, device=device),),
            self.graphs.enabled)
        self._carry = None   # the CarriedRows of the step being run, None: consecutive slots' views
        self._filled = None  # moshi's attention: ring entries to gather (the CPU's steps)

    def close(self) -> None:
        self.prefill.clear()
        self.graphs.clear()  # freed now, not by a garbage collection that may fall in another's capture
        self._reset = self._embed_prefill = None
        self._streaming.__exit__(None, None, None)

    # -- slot life cycle -------------------------------------------------------------------
    def start(self, slot: int, params: SamplingParams) -> None:
        """Fresh state for `slot`, at position 1: position 0 holds the initial tokens.

        This is PersonaPlex's first call, which never runs the model: whatever a sequence's
        first frame forces is overwritten by the initial tokens.
        """
        self.start_many({slot: params})

    def start_many(self, params: dict[int, SamplingParams], reset_model: bool = True) -> None:
        """`start` of several slots at once, each with its settings: one reset of the model's
        streaming state for them all (moshi's walks every module, whatever the rows, so a reset
        a slot would add up to a long stall when many conversations start together). Without
        `reset_model` the caller puts each slot's model state in place (`reset_model`, or
        `restore`, which writes all of it)."""
        slots = to_device(torch.tensor(list(params)), self.device)
        if reset_model:
            self.reset_model(list(params))
        self.grid.start(slots)
        for slot, slot_params in params.items():
            self.sampling.set(slot, slot_params)
        # Graphs are keyed by fixed top-k buckets, never by a client's value.
        top_k, top_k_text = self.sampling.largest_top_k()
        self.top_k_bound = bucket_for(max(top_k, 1), tunables.TOP_K_BUCKETS)
        self.top_k_text_bound = bucket_for(max(top_k_text, 1), tunables.TOP_K_TEXT_BUCKETS)

    def reset_model(self, slots: list[int]) -> None:
        """The model's streaming state of `slots` back to a fresh conversation's. (moshi's
        reset also zeroes each module's host-side step count, `offset_cpu`, which a graphed
        reset does not replay: only per-step weights read it, which the temporal transformer
        has none of, and the depformer's bookkeeping is written out in model_step.py.)"""
        mask = torch.zeros(self.num_slots, dtype=torch.bool)
        mask[slots] = True
        self._reset(mask)

    def snapshot(self, slot: int, filled: int | None = None) -> dict:
        """A copy of everything `slot` has accumulated: its token grid and the temporal
        transformer's streaming state (KV cache up to `filled` entries, offsets). Given
        `filled` (a prefill's positions, known on the host), it waits for nothing on the GPU;
        None reads the slot's length back."""
        return {"grid": self.grid.row(slot), "modules": self.states.snapshot(slot, filled)}

    def restore(self, slots: list[int], snap: dict) -> None:
        """Put a snapshot (of any slot) into each of `slots`."""
        index = to_device(torch.tensor(slots), self.device)
        self.grid.put_row(index, snap["grid"])
        self.states.restore(index, snap["modules"])

    def embed_prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """`embed` of a prefill's tokens [M, 17] (on any device), its own copy."""
        return self._embed_prefill(tokens)[:len(tokens)].clone()

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
        """Advance each active row's slot by one position (row i: slot `inputs.rows[i]`).

        Returns (tokens [b, 17] of position o - 1, has_output [b], input embeddings [b, 1, dim]),
        row by row; rows without output (inactive, or still inside the delays) hold garbage.
        Under CUDA graphs they are views of the graph's own buffers, which the next step overwrites.
        """
        out, emb = self.run_step(inputs.pack(), inputs.embeddings)
        return out[:, :STREAMS], out[:, HAS_OUTPUT].bool(), emb

    @torch.no_grad()
    def run_step(self, packed: torch.Tensor, embeddings: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`step` of packed inputs (step_inputs.py: [b, COLUMNS] int64, on the host) and
        `embeddings` [b, 1, dim] (None: no row embeds). Returns (out [b, STREAMS + 2]: each
        row's tokens, whether it has output (HAS_OUTPUT) and the position it stepped at
        (POSITION); input embeddings [b, 1, dim])."""
        b = packed.shape[0]
        # On a CPU each of the step's ~1000 small ops pays PyTorch's dispatch; inference mode
        # skips their autograd and version-counter bookkeeping (a tenth of the tick). A GPU
        # replays a graph. (Not `inference_mode(False)`: that turns grad mode on.)
        cpu_only = torch.inference_mode() if self.device.type == "cpu" else contextlib.nullcontext()
        rows = None if self.graphs.enabled else packed[:, SLOT]
        first = None if rows is None else int(rows[0])
        if first is not None and torch.equal(rows, torch.arange(first, first + b)):
            # consecutive slots (one conversation, say): the modules see the pool's own rows
            self._carry, self._filled = None, None
            exec_mask = torch.zeros(self.num_slots, dtype=torch.bool, device=self.device)
            exec_mask[first:first + b] = packed[:, ACTIVE].bool().to(self.device)
            self.lm.set_exec_mask(exec_mask)
            seen = self.states.consecutive(first, b)
        else:
            self._carry = self.states.carried(b)
            self._filled = None if rows is None or self.ring_attention else \
                int(self.states.end_offsets()[rows.to(self.device)].max())
            seen = self._carry.seen()
        with seen, cpu_only:
            return self.graphs.run((b, self.top_k_text_bound, self.top_k_bound), packed, embeddings)

    def force_user(self, slots: list[int], positions: np.ndarray, codes: torch.Tensor) -> None:
        """The user's codes [len(slots), 8] of the steps these slots took at `positions` (on the
        host: `run_step`'s POSITION column) with `user_later`: a step's samples do not depend on
        them (the depformer skips the user's codebooks), but the slot's next step reads them, so
        call this before it."""
        self.grid.force(slots, positions, USER, codes)

    def _step(self, packed: torch.Tensor, embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step of packed inputs on the device: the carried rows' streaming state in, the token
        grid's read, the input embeddings (`embeddings` [b, 1, dim] where the rows embed), the
        model, the grid's write, the streaming state out. All tensor ops: the graph's whole
        body. Returns `run_step`'s."""
        rows, active, embed_rows, forced, is_forced = unpack(packed)
        if self._carry is not None:
            self._carry.load(rows, active, self._filled)
        o, previous, target, target_provided = self.grid.read(rows, active, forced, is_forced)
        emb = self.embed(previous)
        emb = torch.where(embed_rows[:, None, None], embeddings.to(emb), emb)
        sampled = self.model_step(emb, target, target_provided, o, self.sampling.at(rows), self.top_k_text_bound,
                                  self.top_k_bound)
        tokens, has_output = self.grid.write(rows, o, active, sampled, target_provided)
        if self._carry is not None:
            self._carry.store(self._filled)
        return torch.cat([tokens, has_output[:, None].long(), o[:, None]], dim=1), emb

    def _no_embeddings(self, b: int) -> torch.Tensor:
        """A step's embeddings [b, 1, dim] when no row embeds (zeros; graphs copy none)."""
        if b not in self._unembedded:
            self._unembedded[b] = torch.zeros(b, 1, self.lm.dim, dtype=self.lm.text_emb.weight.dtype,
                                              device=self.device)
        return self._unembedded[b]
