"""The temporal transformer's moshi streaming state, for a pool of conversation slots: seen as
the first b rows (a batch bucket) or as one slot's row, and copied out of and into a slot.

moshi allocates each module's streaming state for the whole pool (`lm.streaming(num_slots)`).
A view here is a copy of a module's state object whose tensors are views of some rows, so a
module stepped on it reads and writes the pool's own memory: a step of 3 live conversations in
slots 0..2 pays for 4 rows, not for the pool.
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


class SlotStates:
    def __init__(self, transformer, num_slots: int, buckets):
        """`transformer` already streaming for `num_slots` rows; views of the first b rows are
        made once for each b in `buckets` (a CUDA graph keeps the tensors it was captured on)."""
        self.num_slots = num_slots
        self._full = [(m, m._streaming_state) for m in transformer.modules()
                      if getattr(m, "_streaming_state", None) is not None]
        self._first = {b: [(m, _rows_view(state, num_slots, slice(0, b))) for m, state in self._full]
                       for b in buckets}

    def states(self):
        """Each module's streaming state over the whole pool."""
        return [state for _, state in self._full]

    def first(self, b: int):
        """Context: the modules see the first b rows only."""
        if b not in self._first:
            raise ValueError(f"a step runs on a batch bucket {tuple(self._first)}, not on {b} rows")
        return self._seeing(self._first[b])

    def slot(self, slot: int):
        """Context: the modules see one slot's row only."""
        return self._seeing([(m, _rows_view(state, self.num_slots, slice(slot, slot + 1)))
                             for m, state in self._full])

    def snapshot(self, slot: int) -> list[dict]:
        """A copy of `slot`'s rows of every module (its KV cache up to its length)."""
        rows = []
        for state in self.states():
            row = {name: value[slot].clone() for name, value in _batch_tensors(state, self.num_slots)}
            kv = getattr(state, "kv_cache", None)
            if kv is not None:
                length = min(int(kv.end_offset[slot]), kv.capacity)
                row["kv"] = kv.cache[:, slot, :, :length].clone()
                row["kv_end_offset"] = kv.end_offset[slot].clone()
            rows.append(row)
        return rows

    def restore(self, slots: torch.Tensor, rows: list[dict]) -> None:
        """Put a snapshot (of any slot, of a pool whose KV cache may hold another dtype) into
        each of `slots` (an index tensor on the pool's device), all at once."""
        for state, row in zip(self.states(), rows, strict=True):
            for name, value in _batch_tensors(state, self.num_slots):
                value[slots] = row[name]
            if "kv" in row:
                kv = state.kv_cache
                # cache[:, slots] is [2, len(slots), heads, length, dim]: the row's kv gets the slots' axis
                kv.cache[:, slots, :, :row["kv"].shape[2]] = store(row["kv"], kv.cache.dtype).unsqueeze(1)
                kv.end_offset[slots] = row["kv_end_offset"]

    @contextmanager
    def _seeing(self, views):
        for module, view in views:
            module._streaming_state = view
        try:
            yield
        finally:
            for module, state in self._full:
                module._streaming_state = state
