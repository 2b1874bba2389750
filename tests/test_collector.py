"""The garbage collector in a serving process (core/collector.py): what loading made is frozen
out of its walks, each collection is timed by generation, and none runs while paused (a CUDA
graph's capture)."""

import gc
import weakref

import pytest

from personaplex_triton.core.collector import PauseWatch, freeze_loaded, paused


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only a collection frees it


def test_a_watch_times_each_collection_by_generation_until_closed():
    watch = PauseWatch()
    try:
        gc.collect(2)
        gc.collect(1)
        gc.collect(1)
        pauses = watch.take()
        assert len(pauses[2]) >= 1 and len(pauses[1]) >= 2, pauses
        assert all(0 < seconds < 10 for values in pauses.values() for seconds in values)
        assert watch.take() == {}  # taken once
    finally:
        watch.close()
    gc.collect(2)
    assert watch.take() == {} and watch._callback not in gc.callbacks


def test_what_is_loaded_is_frozen_out_of_the_collections_and_garbage_is_not():
    garbage, loaded = Node(), Node()
    garbage_ref, loaded_ref = weakref.ref(garbage), weakref.ref(loaded)
    del garbage  # unreachable before the freeze: its collection frees it
    try:
        assert freeze_loaded() >= 2
        assert garbage_ref() is None
        del loaded  # unreachable after the freeze: no collection walks it any more
        gc.collect()
        assert loaded_ref() is not None
    finally:
        gc.unfreeze()
    gc.collect()
    assert loaded_ref() is None


def test_no_collection_runs_while_paused_and_the_collector_is_as_it_was_after():
    watch = PauseWatch()
    try:
        with paused():
            cycles = [Node() for _ in range(20 * gc.get_threshold()[0])]  # enough to trigger collections
            assert not gc.isenabled()
            assert watch.take() == {}
        assert gc.isenabled()
        del cycles
        with pytest.raises(RuntimeError), paused():
            raise RuntimeError("a failed capture")
        assert gc.isenabled()
        gc.disable()  # a process that had it off keeps it off
        with paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        watch.close()
