"""The temporal transformer's moshi streaming state, for a pool of conversation slots: seen as
the rows a step carries (any slots, through a slot table) or as one slot's row, and copied out
of and into a slot.

moshi allocates each module's streaming state for the whole pool (`lm.streaming(num_slots)`).
A step carries the slots with a frame, packed into b rows (`rows[i]` is row i's slot): the
modules see a copy of each state object whose small per-row tensors (offsets, exec mask) are
gathered into b-row buffers before the model runs and scattered back after, so a tick of 3
conversations among 64 pays for 3 rows (or its bucket), wherever they sit in the pool. The KV
cache is not copied where the attention kernel addresses the pool's ring through the slot
table (ring_attention.py, on CUDA); moshi's attention (the CPU) gets the carried rows' rings
gathered up to their filled length, or plain views when the slots are consecutive.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from .kv_cache import store


def _batch_tensors(state, batch_size: int):
    """(name, tensor) of a moshi streaming state's per-row tensors (batch dim first)."""
    for name, value in vars(state).items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch_size:
            yield name, value


def _rows_view(state, num_slots: int, rows: slice):
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


@contextmanager
def _seeing(views: list):
    """Context: each module sees its view ((module, pool state, view) each); afterwards its
    pool state again."""
    for module, _, view in views:
        module._streaming_state = view
    try:
        yield
    finally:
        for module, state, _ in views:
            module._streaming_state = state


class CarriedRows:
    """The modules' states over the b rows a step carries: b-row copies of each state's small
    tensors, filled from the pool's rows `rows[i]` by `load` and written back by `store`; both
    are tensor ops, so a CUDA graph of the step takes them in (its slot table is an input).

    `indexed_kv`: the KV caches stay the pool's, and each view's `kv_cache.rows` is the slot
    table the attention kernel reads (ring_attention.py). Otherwise (moshi's attention) each
    view gets a b-row ring: `load` gathers the carried rows' rings up to `filled` entries and
    `store` writes them back up to one past it (the entry a step adds)."""

    def __init__(self, full: list, num_slots: int, b: int, device, indexed_kv: bool):
        self.num_slots = num_slots
        self.indexed_kv = indexed_kv
        self.rows = torch.arange(b, device=device)  # the slot table; `load` copies a step's into it
        self.views = []
        for module, state in full:
            view = copy.copy(state)
            view.batch_size = b
            for name, value in _batch_tensors(state, num_slots):
                setattr(view, name, value.new_zeros((b, *value.shape[1:])))
            kv = getattr(state, "kv_cache", None)
            if kv is not None:
                kv_view = copy.copy(kv)
                kv_view.end_offset = kv.end_offset.new_zeros(b)
                if indexed_kv:
                    kv_view.rows = self.rows
                else:
                    kv_view.cache = kv.cache.new_zeros((kv.cache.shape[0], b, *kv.cache.shape[2:]))
                view.kv_cache = kv_view
            self.views.append((module, state, view))

    def load(self, rows: torch.Tensor, active: torch.Tensor, filled: int | None = None) -> None:
        """Fill the buffers from the pool's `rows` [b]; the carried rows' exec mask is `active`.
        `filled`: how many ring entries to gather (moshi's attention only; None: the whole ring)."""
        self.rows.copy_(rows)
        for _, state, view in self.views:
            for name, value in _batch_tensors(state, self.num_slots):
                getattr(view, name).copy_(active if name == "exec_mask" else value[rows])
            kv = getattr(state, "kv_cache", None)
            if kv is not None:
                view.kv_cache.end_offset.copy_(kv.end_offset[rows])
                if not self.indexed_kv:
                    n = kv.capacity if filled is None else min(filled, kv.capacity)
                    view.kv_cache.cache[:, :, :, :n] = kv.cache[:, rows, :, :n]

    def store(self, filled: int | None = None) -> None:
        """Write the buffers back into the pool's rows (those of the last `load`)."""
        rows = self.rows
        for _, state, view in self.views:
            for name, value in _batch_tensors(state, self.num_slots):
                if name != "exec_mask":
                    value[rows] = getattr(view, name)
            kv = getattr(state, "kv_cache", None)
            if kv is not None:
                kv.end_offset[rows] = view.kv_cache.end_offset
                if not self.indexed_kv:
                    n = kv.capacity if filled is None else min(filled + 1, kv.capacity)
                    kv.cache[:, rows, :, :n] = view.kv_cache.cache[:, :, :, :n]

    def seen(self):
        """Context: the modules see these rows."""
        return _seeing(self.views)


class SlotStates:
    def __init__(self, transformer, num_slots: int, indexed_kv: bool):
        """`transformer` already streaming for `num_slots` rows. `indexed_kv`: the attention
        kernel reads the pool's KV cache through the slot table (CarriedRows)."""
        self.num_slots = num_slots
        self.indexed_kv = indexed_kv
        self._full = [(m, m._streaming_state) for m in transformer.modules()
                      if getattr(m, "_streaming_state", None) is not None]
        self._carried: dict[int, CarriedRows] = {}

    def carried(self, b: int) -> CarriedRows:
        """The b-row buffers of a step (made once for each b: a CUDA graph keeps the tensors it
        was captured on)."""
        if b not in self._carried:
            device = self._full[0][1].exec_mask.device
            self._carried[b] = CarriedRows(self._full, self.num_slots, b, device, self.indexed_kv)
        return self._carried[b]

    def one_slot(self) -> CarriedRows:
        """One row's buffers, with a whole ring, for moshi's attention (a persona's prefill under
        CUDA graphs, prefill_graphs.py)."""
        device = self._full[0][1].exec_mask.device
        return CarriedRows(self._full, self.num_slots, 1, device, indexed_kv=False)

    def consecutive(self, first: int, b: int):
        """Context: the modules see the b slots from `first` (views; no copies)."""
        return _seeing([(m, state, _rows_view(state, self.num_slots, slice(first, first + b)))
                        for m, state in self._full])

    def end_offsets(self) -> torch.Tensor:
        """Each slot's count of ring entries written (every layer's ring steps alike)."""
        return next(state.kv_cache.end_offset for _, state in self._full
                    if getattr(state, "kv_cache", None) is not None)

    def states(self):
        """Each module's streaming state over the whole pool."""
        return [state for _, state in self._full]

    def slot(self, slot: int):
        """Context: the modules see one slot's row only."""
        return self.consecutive(slot, 1)

    def _rows_by_name(self) -> dict[str, list[torch.Tensor]]:
        """The pool's per-row tensors of every module's state (and each ring's `end_offset`, as
        "kv_end_offset"), by name, each list in the modules' order."""
        named: dict[str, list[torch.Tensor]] = {}
        for state in self.states():
            for name, value in _batch_tensors(state, self.num_slots):
                named.setdefault(name, []).append(value)
            kv = getattr(state, "kv_cache", None)
            if kv is not None:
                named.setdefault("kv_end_offset", []).append(kv.end_offset)
        return named

    def _rings(self) -> list:
        return [kv for kv in (getattr(state, "kv_cache", None) for state in self.states()) if kv is not None]

    def snapshot(self, slot: int, filled: int | None = None) -> dict:
        """A copy of `slot`'s rows of every module: "rows", each per-row tensor's row stacked by
        name [modules, ...]; "kv", every layer's KV cache up to `filled` entries [layers, 2, heads,
        entries, dim] (None: up to the slot's length, read back from the device). A kernel a
        name and one for the caches (a copy of each tensor was about 200 kernels on the 7B);
        given `filled`, nothing waits for the GPU."""
        rings = self._rings()
        if filled is None:
            filled = int(rings[0].end_offset[slot]) if rings else 0
        snap = {"rows": {name: torch.stack([value[slot] for value in values])
                         for name, values in self._rows_by_name().items()}}
        if rings:
            entries = min(filled, rings[0].capacity)
            snap["kv"] = torch.stack([kv.cache[:, slot, :, :entries] for kv in rings])
        return snap

    def restore(self, slots: torch.Tensor, snap: dict) -> None:
        """Put a snapshot (of any slot, of a pool whose KV cache may hold another dtype) into
        each of `slots` (an index tensor on the pool's device), all at once: per name, the pool's
        tensors stacked, the slots' rows written and the stack copied back in one call; the
        caches' entries a call a layer."""
        for name, values in self._rows_by_name().items():
            pool = torch.stack(values)
            pool[:, slots] = snap["rows"][name].unsqueeze(1).to(pool)
            torch._foreach_copy_(values, list(pool.unbind(0)))
        if "kv" in snap:
            rings = self._rings()
            kv = store(snap["kv"], rings[0].cache.dtype)
            for ring, layer in zip(rings, kv.unbind(0), strict=True):  # a kernel a layer, whatever the slots
                ring.cache[:, slots, :, :layer.shape[2]] = layer.unsqueeze(1)
