"""A stage in a process of its own (engine/stage_process.py): the engine's calls cross a pipe
to a real child Python process, in order, with their errors, and a child that dies stops the
engine with an error for every pending request."""

import os
import threading
from pathlib import Path

import pytest

import stage_doubles
from personaplex_triton.core.errors import SlotFault
from personaplex_triton.engine.engine import SlotEngine
from personaplex_triton.engine.stage_process import StageProcess, StageProcessDied


@pytest.fixture(autouse=True)
def tests_on_the_childs_path(monkeypatch):
    """The child imports stage_doubles by name, from this folder."""
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))


@pytest.fixture
def echo():
    events = []
    stage = StageProcess("echo", stage_doubles.build_echo, {"num_slots": 3}, on_event=lambda *e: events.append(e))
    stage.events = events
    yield stage
    stage.close()


def test_the_stage_ticks_in_its_own_process_and_runs_calls_in_the_order_sent(echo):
    assert echo.num_slots == 3 and echo.info["pid"] == echo.pid != os.getpid()
    assert echo.tick({0: "a", 2: "b"}) == {0: ("a", echo.pid, 1), 2: ("b", echo.pid, 1)}
    assert echo.tick({0: "c"}) == {0: ("c", echo.pid, 2)}
    assert echo.last_tick_cpu_s >= 0
    echo.stop(1)  # sent without waiting: still done before the next call
    echo.stop(2)
    assert echo.tick({0: "stopped"}) == {0: [1, 2]}
    assert echo.prefill_many({1: "x", 2: "bad"}).keys() == {2}
    assert echo.events == [("started", 1)]  # what the stage emitted came back with the answer


def test_a_prefill_in_chunks_runs_one_chunk_a_call_and_keeps_its_failures(echo):
    job = echo.begin_prefills({1: "chunks"})
    assert [job.advance() for _ in range(3)] == [False, False, True] and job.failed == {}
    assert echo.events == [("started", 1)]
    bad = echo.begin_prefills({2: "bad"})
    assert bad.advance() is True
    assert isinstance(bad.failed[2], ValueError) and "slot 2: a bad setup" in str(bad.failed[2])


def test_a_slot_fault_crosses_with_its_slot_and_the_stage_goes_on(echo):
    with pytest.raises(SlotFault, match="slot 2 cannot step") as fault:
        echo.tick({0: "a", 2: "fault"})
    assert fault.value.slot == 2
    assert echo.tick({0: "a"}) == {0: ("a", echo.pid, 2)}  # the failed tick had counted slot 0's item


def test_a_call_unread_or_unanswerable_and_a_failing_stop_fail_alone_and_the_stage_goes_on(echo):
    with pytest.raises(RuntimeError, match="could not read the call: .*cannot be read in the stage's process"):
        echo.tick({0: stage_doubles.Unreadable()})
    with pytest.raises(RuntimeError, match="the echo stage's answer could not be sent back: .*pickle local object"):
        echo.tick({0: "unsendable"})
    with pytest.raises(RuntimeError, match="the echo stage's answer could not be sent back"):
        echo.tick({0: "unsendable event"})  # its events cannot cross either: dropped, logged
    assert echo.events == []
    echo.stop(-1)  # fails in the child, which logs it
    echo.stop(1)
    assert echo.tick({0: "stopped"}) == {0: [1]}
    assert echo.tick({0: "a"}) == {0: ("a", echo.pid, 1)}  # the unanswered tick counted slot 0's item


def test_a_build_that_fails_raises_its_error_here():
    with pytest.raises(RuntimeError, match="this stage cannot be built"):
        StageProcess("broken", stage_doubles.build_failing, {})


def test_a_child_that_dies_fails_every_later_call(echo):
    with pytest.raises(StageProcessDied, match="exit status 3"):
        echo.tick({0: "exit"})
    echo.stop(0)  # nothing to stop: no error
    with pytest.raises(StageProcessDied):
        echo.tick({0: "a"})


def test_an_engine_whose_stage_process_dies_stops_with_an_error_for_each_pending_request(echo):
    engine = SlotEngine(echo, name="echo")
    done = {}
    finished = threading.Event()

    def on_done(key):
        def record(error):
            done[key] = error
            if len(done) == 2:
                finished.set()
        return record

    engine.open(1, "x")
    engine.open(2, "x")
    answers = []
    engine.submit(1, ["a"], lambda out, i, last: answers.append(out), lambda e: None)
    engine.submit(2, ["exit"] + ["b"] * 3, lambda out, i, last: None, on_done(2))
    engine.submit(1, ["c"] * 3, lambda out, i, last: None, on_done(1))
    assert finished.wait(30)
    assert all("stage's process" in error and "is gone" in error for error in done.values()), done
    assert not engine.healthy and "is gone" in engine.failure
    engine.shutdown(0)


def test_a_child_that_dies_between_ticks_stops_its_engine_at_the_next_heartbeat(echo):
    import signal
    import time

    engine = SlotEngine(echo, name="echo")
    os.kill(echo.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while engine.healthy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.healthy and "exit status -9" in engine.failure
    engine.shutdown(0)


def test_a_ctrl_c_to_the_process_group_leaves_the_child_to_the_stub(echo):
    """A terminal's Ctrl-C (SIGINT to every process of the group) must not end the child under
    a stub that is still draining: the stub ends it."""
    import signal
    import time

    os.kill(echo.pid, signal.SIGINT)
    time.sleep(0.5)
    assert echo.tick({0: "a"}) == {0: ("a", echo.pid, 1)}
