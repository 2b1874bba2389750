"""Python's garbage collector in a serving process: what loading made is frozen out of its
walks, and each collection's pause is timed.

A collection holds the GIL from start to end, so every thread of a Triton stub waits for it,
the tick's thread among them. A full one (generation 2) walks every object the collector
tracks. Once the talker has loaded (torch, moshi, the model's modules), its process tracks
hundreds of thousands of objects, and a full collection of them holds every thread for longer
than a tick. Those objects live as long as the process: frozen (`gc.freeze`), a collection
skips them. While a CUDA graph is captured, no collection runs at
all (`paused`).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import time


def freeze_loaded() -> int:
    """Collect what loading left behind, then move every object still tracked out of the
    collector's walks for good (`gc.freeze`): a later collection walks only what serving made.
    Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def paused():
    """No automatic collection inside the block; the collector is as it was after it. A CUDA
    graph freed by a collection (of some unclosed generator's cycle, say) while another graph
    is being captured invalidates that capture. Pausing costs nothing, where collecting before
    each capture was a full walk of the loaded process each time (a talker captures about a
    hundred graphs at load)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class PauseWatch:
    """Times each collection of this process from `__init__` to `close` (`gc.callbacks`).
    The callback only appends to a deque, which takes no lock: a collection can start in any
    thread, inside any code, a metric queue's lock held among them."""

    def __init__(self):
        self._pauses: collections.deque[tuple[int, float]] = collections.deque()
        self._started = 0.0  # collections do not overlap: the GIL is held throughout one
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._pauses.append((info["generation"], time.perf_counter() - self._started))

    def take(self) -> dict[int, list[float]]:
        """The pauses (s) since the last take, by generation."""
        taken: dict[int, list[float]] = {}
        while self._pauses:
            generation, seconds = self._pauses.popleft()
            taken.setdefault(generation, []).append(seconds)
        return taken

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
