"""PersonaPlex's token grid for a pool of conversation slots: which token each stream holds at
each position, with the streams' delays.

Per slot a ring buffer `cache[17, max_delay + 3]` of tokens (row 0 text, 1..8 agent audio,
9..16 user audio) with `provided` flags for forced tokens, and the slot's position `offset`.
A step at position `o` writes the forced tokens at `o + delay`, reads position `o - 1` (the
transformer's input) and position `o` (what it predicts, and what was forced there), then
fills `o` with the samples where nothing was forced and, once past the delays, gives position
`o - max_delay` with every stream aligned. Rows outside `active` are left as they were.

The grid lives where its tensors are: the GPU for the batched steps; a copy of one row on the
CPU plays a persona's prefill (hundreds of forced steps of a few tiny ops each, which on the
GPU would each cost a kernel launch).
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from ..core.host_copies import to_device

NUM_AUDIO = 8  # codebooks per audio stream


class TokenGrid:
    def __init__(self, num_slots: int, delays: list[int], initial: torch.Tensor, ungenerated: int, device):
        self.device = torch.device(device)
        self.delays = torch.tensor(delays, dtype=torch.long, device=self.device)
        self._host_delays = np.array(delays, dtype=np.int64)  # `force` builds its index on the host
        self._true = torch.ones((), dtype=torch.bool, device=self.device)
        self.max_delay = int(max(delays))
        self.ring = self.max_delay + 3
        self.num_codebooks = K = len(delays)
        self.initial = initial.to(self.device)  # [17]
        self._host_initial = initial.cpu()  # a fresh row is built on the host without waiting for the GPU
        self.ungenerated = ungenerated
        self.cache = torch.full((num_slots, K, self.ring), ungenerated, dtype=torch.long, device=self.device)
        self.provided = torch.zeros((num_slots, K, self.ring), dtype=torch.bool, device=self.device)
        self.offset = torch.zeros(num_slots, dtype=torch.long, device=self.device)

    def start(self, slots: int | torch.Tensor) -> None:
        """Fresh state for a slot (or for each slot of an index tensor), at position 1:
        position 0 holds the initial tokens."""
        self.cache[slots] = self.ungenerated
        self.provided[slots] = False
        self.cache[slots, :, 0] = self.initial
        self.provided[slots, :, 0] = True
        self.offset[slots] = 1

    def row(self, slot: int) -> "TokenGrid":
        """A grid of one row where this one is: a copy of `slot`'s (`put_row` writes it back),
        made on the device without waiting for it."""
        grid = copy.copy(self)  # the delays and initial tokens are shared: nothing writes them
        grid.cache, grid.provided, grid.offset = (t[slot:slot + 1].clone() for t in (self.cache, self.provided, self.offset))
        return grid

    def fresh_row(self) -> "TokenGrid":
        """A grid of one row on the CPU, as `start` leaves a slot: what `row(slot, "cpu")` gives
        of a slot just started, without reading it back from the device."""
        grid = TokenGrid(1, self._host_delays.tolist(), self._host_initial, self.ungenerated, "cpu")
        grid.start(0)
        return grid

    def put_row(self, slots: int | torch.Tensor, grid: "TokenGrid") -> None:
        """Copy a one-row grid into a slot (or into each slot of an index tensor)."""
        self.cache[slots], self.provided[slots], self.offset[slots] = (
            to_device(t[0], self.device) for t in (grid.cache, grid.provided, grid.offset))

    def read(self, rows: torch.Tensor, active, forced, is_forced):
        """Write each active row's forced tokens [b, K] (where `is_forced`) at o + delay (the
        delayed streams start from the initial token) and read the grid. Row i is slot `rows[i]`
        (distinct slots; an inactive row's slot is left as it was).

        Returns (o [b], tokens of position o - 1 [b, K], what position o holds [b, K] and
        whether it was forced there [b, K])."""
        K, CT = self.num_codebooks, self.ring
        cache, provided = self.cache[rows], self.provided[rows]
        b = active.shape[0]
        o = self.offset[rows].clone()
        write = (o[:, None] + self.delays[None, :]) % CT  # [b, K]
        _scatter(cache, provided, write, forced, is_forced & active[:, None])
        at_start = (o[:, None] <= self.delays[None, :]) & active[:, None]
        _scatter(cache, provided, (o % CT)[:, None].expand(b, K), self.initial[None, :].expand(b, K), at_start)
        self.cache[rows], self.provided[rows] = cache, provided
        src = ((o - 1) % CT)[:, None, None].expand(b, K, 1)
        dst = (o % CT)[:, None, None].expand(b, K, 1)
        return o, cache.gather(2, src)[:, :, 0], cache.gather(2, dst)[:, :, 0], provided.gather(2, dst)[:, :, 0]

    def play_forced(self, forced: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """M steps of row 0 with every stream forced ([M, K] tokens), at once: the grid is left
        as M `read`s and `write`s of the row, active, leave it (a persona's prefill, whose
        hundreds of steps would each cost a few dozen tiny ops). Returns what each step reads:
        the tokens of position o - 1 and whether position o was forced, [M, K] each.

        Step i (o = o0 + i) writes position o + delay, a delayed stream's initial token at o
        while o <= delay, and clears `provided` at o - 1: no two steps write a stream's position,
        and a later step writes larger positions. So the steps are laid out on a timeline of
        positions o0 - 1 .. o0 + M - 1 + max_delay, and each ring slot ends with the largest
        position written to it (the ring as it was where none is)."""
        M, K, CT = forced.shape[0], self.num_codebooks, self.ring
        o0 = int(self.offset[0])
        n = M + 1 + self.max_delay                    # timeline index j: position o0 - 1 + j
        j = torch.arange(n, device=self.device)
        slot = (o0 - 1 + j) % CT
        values = self.cache[0][:, slot]               # [K, n], where nothing is written: the ring's
        written = torch.zeros(K, n, dtype=torch.bool, device=self.device)
        steps = torch.arange(M, device=self.device)
        at = steps[None, :] + 1 + self.delays[:, None]  # [K, M]: step i's forced token goes to o + delay
        values.scatter_(1, at, forced.T.to(values))
        written.scatter_(1, at, torch.ones_like(at, dtype=torch.bool))
        at_start = (o0 + steps)[None, :] <= self.delays[:, None]  # [K, M], at o = o0 + i: j = i + 1
        values[:, 1:M + 1] = torch.where(at_start, self.initial[:, None], values[:, 1:M + 1])
        written[:, 1:M + 1] |= at_start
        previous = values[:, :M].T
        # position o was forced by this or an earlier step, or, for the first steps, before them
        before = (steps[None, :] + 1 < CT) & self.provided[0][:, slot[1:M + 1]]
        target_provided = (written[:, 1:M + 1] | before).T
        provided = written & (j >= M)                 # step i clears j = i (o - 1), after any write there
        self.cache[0] = _last_per_slot(values, written, slot, self.cache[0])
        self.provided[0] = _last_per_slot(provided, written | (j < M), slot, self.provided[0])
        self.offset[0] = o0 + M
        return previous, target_provided

    def force(self, slots, o, streams: slice, values: torch.Tensor) -> None:
        """Force `values` [len(slots), streams] at o + delay, as a step at position o would have.
        `slots` and `o` (each slot's position) are on the host: the index is built there and
        reaches the device in one copy (each PyTorch call lets other threads take the GIL),
        without waiting for the stream's queued work (host_copies.py: the last tick's encode,
        which `values` come from)."""
        books = np.arange(self.num_codebooks)[streams]
        positions = (np.asarray(o)[:, None] + self._host_delays[streams][None, :]) % self.ring
        index = torch.from_numpy(np.stack(np.broadcast_arrays(np.asarray(slots)[:, None], books[None, :], positions)))
        rows, codebooks, at = to_device(index.reshape(3, -1), self.device).unbind()
        self.cache.index_put_((rows, codebooks, at), values.reshape(-1).to(self.cache))
        self.provided.index_put_((rows, codebooks, at), self._true)

    def write(self, rows: torch.Tensor, o, active, sampled, target_provided):
        """Samples fill position o where nothing was forced; o - 1 is done; active rows move on
        (row i is slot `rows[i]`, as in `read`). Returns (tokens [b, K] of position
        o - max_delay, has_output [b])."""
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
        self.cache[rows], self.provided[rows] = cache, provided
        self.offset[rows] = torch.where(active, o + 1, o)
        return tokens, has_output


def _scatter(cache: torch.Tensor, provided: torch.Tensor, positions: torch.Tensor, values: torch.Tensor,
             mask: torch.Tensor) -> None:
    """cache[s, k, positions[s, k]] = values[s, k] and provided = True, where mask[s, k]."""
    idx = positions[:, :, None]
    current = cache.gather(2, idx)[:, :, 0]
    cache.scatter_(2, idx, torch.where(mask, values, current)[:, :, None])
    was = provided.gather(2, idx)[:, :, 0]
    provided.scatter_(2, idx, (was | mask)[:, :, None])


def _last_per_slot(timeline: torch.Tensor, touched: torch.Tensor, slot: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
    """Per stream and ring slot, the timeline's value at the last index touched in that slot
    ([K, n], slot [n]), else the ring's ([K, CT])."""
    index = torch.arange(timeline.shape[1], device=timeline.device).expand_as(timeline)
    last = torch.full(ring.shape, -1, dtype=torch.long, device=ring.device).scatter_reduce(
        1, slot.expand_as(timeline), torch.where(touched, index, -1), "amax")
    return torch.where(last >= 0, timeline.gather(1, last.clamp(min=0)), ring)
