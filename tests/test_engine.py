"""The slot engine's scheduling, on a small arithmetic stage (no model needed)."""

import os
import threading
import time

import pytest
import torch

from personaplex_triton.engine.engine import ConversationError, SlotEngine
from personaplex_triton.engine.stage import Stage
from personaplex_triton.engine.prefills import PrefillJob
from polling import wait_for


class CountingStage(Stage):
    """Each slot answers item x with (x, how many items the slot has seen). A start with the
    setup "held" lasts until `release` is set (`holding` says one has begun), as the talker's
    start lasts its persona's prefill: what is submitted meanwhile queues up. Each tick sleeps
    `tick_s`, so that a request of many items stays pending a while."""

    def __init__(self, num_slots, tick_s=0.0):
        self.num_slots = num_slots
        self.tick_s = tick_s
        self.seen = [0] * num_slots
        self.fail_on = None
        self.batch_sizes = []
        self.starts = []  # the slots of each prefill_many call
        self.holding, self.release = threading.Event(), threading.Event()

    def prefill_many(self, setups):
        self.starts.append(sorted(setups))
        failed = {}
        for slot, setup in setups.items():
            if setup == "bad":
                failed[slot] = ValueError("bad setup")
                continue
            self.seen[slot] = 0
            if setup == "held":
                self.holding.set()
                self.release.wait(30)
        return failed

    def stop(self, slot):
        pass

    def tick(self, items):
        time.sleep(self.tick_s)
        if self.fail_on is not None and self.fail_on in items.values():
            raise RuntimeError("boom")
        self.batch_sizes.append(len(items))
        out = {}
        for slot, item in items.items():
            self.seen[slot] += 1
            out[slot] = (item, self.seen[slot])
        return out


class Collector:
    def __init__(self):
        self.outputs, self.indices, self.lasts, self.errors = [], [], [], []
        self.done = threading.Event()

    def on_output(self, output, index, last):
        self.outputs.append(output)
        self.indices.append(index)
        self.lasts.append(last)

    def on_done(self, error):
        self.errors.append(error)
        self.done.set()

    def wait(self):
        assert self.done.wait(10), "request never finished"


@pytest.fixture
def engine():
    stage = CountingStage(2)
    engine = SlotEngine(stage)
    yield engine
    engine.shutdown()


def hold_start(engine, key):
    """Open conversation `key` with a "held" start and wait until the engine is in it."""
    engine.open(key, "held")
    assert engine.stage.holding.wait(10)


def run(engine, key, items, close=False):
    c = Collector()
    engine.submit(key, items, c.on_output, c.on_done, close=close)
    c.wait()
    return c


def live_conversation(engine, frames: int) -> Collector:
    """Conversation 1 opened, its first tick run, then `frames` frames sent to tick on (not waited for)."""
    engine.open(1, None)
    run(engine, 1, ["warm"])
    live = Collector()
    engine.submit(1, list(range(frames)), live.on_output, live.on_done)
    return live


def test_items_answered_once_each_in_order(engine):
    engine.open(1, None)
    c = run(engine, 1, list(range(5)))
    assert c.outputs == [(i, i + 1) for i in range(5)]
    assert c.lasts == [False] * 4 + [True]  # the last output completes the request
    assert c.errors == [None]
    c = run(engine, 1, [10, 11])
    assert c.outputs == [(10, 6), (11, 7)]
    assert c.indices == [5, 6]  # counted over the whole conversation


def test_conversations_share_ticks(engine):
    engine.open(1, None)
    hold_start(engine, 2)  # both conversations queue up meanwhile
    a, b = Collector(), Collector()
    engine.submit(1, list(range(20)), a.on_output, a.on_done)
    engine.submit(2, list(range(20)), b.on_output, b.on_done)
    engine.stage.release.set()
    a.wait(), b.wait()
    assert [x for x, _ in a.outputs] == list(range(20)) == [x for x, _ in b.outputs]
    assert engine.stage.batch_sizes == [2] * 20


def test_slot_limit_and_release(engine):
    engine.open(1, None)
    engine.open(2, None)
    with pytest.raises(ConversationError, match="slots are busy"):
        engine.open(3, None)
    with pytest.raises(ConversationError, match="already open"):
        engine.open(1, None)
    run(engine, 1, [1], close=True)
    with pytest.raises(ConversationError, match="not open"):
        engine.submit(1, [2], lambda o, i, last: None, lambda e: None)
    engine.open(3, None)  # at once: the closed conversation's slot is as good as free
    assert sorted(engine.open_keys()) == [2, 3]
    assert run(engine, 3, ["x"]).outputs == [("x", 1)]


def test_key_reusable_as_soon_as_closed():
    """A client (or perf_analyzer) may start a new sequence with the id it just ended."""
    stage = CountingStage(1)
    engine = SlotEngine(stage)
    try:
        for round_ in range(5):
            engine.open(7, None)
            assert run(engine, 7, ["a", "b"], close=True).outputs == [("a", 1), ("b", 2)], round_
    finally:
        engine.shutdown()


def test_empty_closing_request_frees_slot(engine):
    engine.open(1, None)
    c = run(engine, 1, [], close=True)
    assert c.outputs == [] and c.errors == [None]
    assert not engine.is_open(1)


def test_failed_start_reports_error(engine):
    engine.open(1, "bad")
    c = Collector()
    try:
        engine.submit(1, [1], c.on_output, c.on_done)
        c.wait()
        assert c.errors and "bad setup" in c.errors[0]
    except ConversationError:
        pass  # the start already failed and closed the conversation
    assert not engine.is_open(1)


def test_conversations_admitted_together_start_together_and_a_bad_one_fails_alone():
    stage = CountingStage(4)
    engine = SlotEngine(stage)
    try:
        hold_start(engine, 1)  # the next three are admitted while the engine is in this start
        for key, setup in ((2, None), (3, "bad"), (4, None)):
            engine.open(key, setup)
        stage.release.set()
        good, bad = run(engine, 2, ["a"]), Collector()
        assert good.outputs == [("a", 1)] and good.errors == [None]
        assert run(engine, 4, ["b"]).outputs == [("b", 1)]
        try:
            engine.submit(3, ["c"], bad.on_output, bad.on_done)
            bad.wait()
            assert bad.outputs == [] and "bad setup" in bad.errors[0]
        except ConversationError as exc:
            assert "not open" in str(exc)  # its start already failed and closed it
        assert [len(slots) for slots in stage.starts] == [1, 3]
    finally:
        engine.shutdown()


def test_stage_error_fails_only_its_tick(engine):
    engine.open(1, None)
    engine.open(2, None)
    engine.stage.fail_on = "poison"
    bad = run(engine, 1, ["poison", "never"])
    assert bad.errors[0] and "boom" in bad.errors[0]
    assert not engine.is_open(1)
    good = run(engine, 2, ["fine"])
    assert good.outputs == [("fine", 1)] and good.errors == [None]


def test_idle_conversation_evicted_when_full():
    stage = CountingStage(1)
    engine = SlotEngine(stage, evict_after_s=0.0)
    try:
        engine.open(1, None)
        run(engine, 1, [1])
        engine.open(2, None)  # 1 is idle: replaced
        assert run(engine, 2, [5]).outputs == [(5, 1)]
        assert not engine.is_open(1)
    finally:
        engine.shutdown()


def test_restart_resets_an_idle_conversation(engine):
    engine.open(1, None)
    run(engine, 1, [1, 2])
    engine.open(1, None, restart=True)
    assert run(engine, 1, [3]).outputs == [(3, 1)]


# -- faults, limits of time, health -------------------------------------------------------
from personaplex_triton.core.errors import SlotFault  # noqa: E402
from personaplex_triton.core.fault_injection import FaultPlan  # noqa: E402
from personaplex_triton.core.metrics import Metrics  # noqa: E402


class RecordingMetrics(Metrics):
    def __init__(self):
        self.rejected_reasons, self.frames, self.ticks, self.up = [], 0, 0, []

    def rejected(self, reason):
        self.rejected_reasons.append(reason)

    def frame_answered(self, latency_s):
        assert latency_s >= 0
        self.frames += 1

    def tick(self, seconds, frames):
        assert frames >= 1
        self.ticks += 1

    def alive(self, up):
        self.up.append(up)


def test_failing_send_ends_only_its_conversation(engine):
    engine.open(1, None)
    engine.open(2, None)
    bad, good = Collector(), Collector()

    def broken(output, index, last):
        raise RuntimeError("client gone")

    engine.submit(1, [1, 2, 3], broken, bad.on_done)
    engine.submit(2, [1, 2, 3], good.on_output, good.on_done)
    bad.wait(), good.wait()
    assert "could not send a response: client gone" in bad.errors[0]
    assert good.outputs == [(1, 1), (2, 2), (3, 3)] and good.errors == [None]
    assert not engine.is_open(1) and engine.is_open(2) and engine.healthy


class FaultyStage(CountingStage):
    """Fails ticks on a schedule: `faults` is a list of exceptions to raise, one per tick that
    has an item."""

    def __init__(self, num_slots):
        super().__init__(num_slots)
        self.faults = []

    def tick(self, items):
        if self.faults and items:
            raise self.faults.pop(0)
        return super().tick(items)


def test_fault_naming_a_slot_ends_that_conversation_only():
    stage = FaultyStage(2)
    engine = SlotEngine(stage, metrics=(metrics := RecordingMetrics()))
    try:
        engine.open(1, None)
        hold_start(engine, 2)  # both conversations' first items step in one tick
        stage.faults = [SlotFault(0, "bad row")]  # slot 0 is conversation 1's
        a, b = Collector(), Collector()
        engine.submit(1, ["a"], a.on_output, a.on_done)
        engine.submit(2, ["b1", "b2"], b.on_output, b.on_done)
        stage.release.set()
        a.wait(), b.wait()
        assert "internal error while stepping this conversation: bad row" in a.errors[0]
        assert [x for x, _ in b.outputs] == ["b1", "b2"] and b.errors == [None]
        assert metrics.rejected_reasons == ["internal"]
    finally:
        engine.shutdown()


def test_a_later_request_of_a_conversation_ended_by_a_fault_names_the_fault():
    # Its answers and those of its earlier requests race to the client: each must name the cause.
    stage = FaultyStage(2)
    engine = SlotEngine(stage)
    try:
        engine.open(1, None)
        stage.faults = [SlotFault(0, "bad row")]
        assert "bad row" in run(engine, 1, ["a"]).errors[0]
        with pytest.raises(ConversationError, match="conversation 1 is not open: it ended with an error: "
                                                    "internal error while stepping this conversation: bad row"):
            run(engine, 1, ["b"])
        engine.open(1, None)  # the key's next conversation starts clean, and ends without an error
        assert run(engine, 1, ["c"], close=True).errors == [None]
        with pytest.raises(ConversationError, match=r"conversation 1 is not open \(its start request failed"):
            run(engine, 1, ["d"])
    finally:
        engine.shutdown()


def test_unattributed_fault_is_retried_once():
    stage = FaultyStage(2)
    engine = SlotEngine(stage)
    try:
        engine.open(1, None)
        stage.faults = [RuntimeError("transient")]
        c = run(engine, 1, ["x", "y"])
        assert c.outputs == [("x", 1), ("y", 2)] and c.errors == [None]
    finally:
        engine.shutdown()


def test_a_step_that_cannot_be_repeated_ends_its_conversations_without_a_retry():
    """StepNotRepeatable (a stage whose state moved before it failed): no retry, which would step
    the conversations twice; they get the error, and out of memory turns newcomers away."""
    import pickle

    from personaplex_triton.core.errors import StepNotRepeatable

    fault = pickle.loads(pickle.dumps(StepNotRepeatable("decoding the tick's audio failed", out_of_memory=True)))
    assert str(fault) == "decoding the tick's audio failed" and fault.out_of_memory  # crosses a stage's pipe
    stage = FaultyStage(2)
    engine = SlotEngine(stage, metrics=(metrics := RecordingMetrics()))
    try:
        engine.open(1, None)
        stage.faults = [fault]
        c = run(engine, 1, ["x"])
        assert c.outputs == [] and "decoding the tick's audio failed" in c.errors[0]  # a retry would have answered
        assert metrics.rejected_reasons == ["internal"]
        with pytest.raises(ConversationError, match="ran out of GPU memory"):
            engine.open(2, None)
    finally:
        engine.shutdown()


def test_the_schedulers_tick_model_takes_every_tick_the_stage_ran():
    from personaplex_triton.engine.scheduler import MODEL_MIN_TICKS

    stage = CountingStage(2)
    engine = SlotEngine(stage)
    try:
        engine.open(1, None)
        assert engine.scheduler.model.fit() is None
        run(engine, 1, list(range(MODEL_MIN_TICKS)))
        fixed, per_frame = engine.scheduler.model.fit()  # one conversation: ticks of 1 frame
        assert fixed > 0 and per_frame == 0
    finally:
        engine.shutdown()


def test_admission_by_the_live_answers_counts_a_frame_from_when_it_could_be_answered():
    """Sixty frames in one request (an offline client's burst) wait for their own conversation's
    earlier frames, not for the server: about one 30 ms tick each, however long the burst."""
    from personaplex_triton.engine.scheduler import LATENCY_MIN_FRAMES

    for limit_s, refused in ((0.2, False), (0.01, True)):
        engine = SlotEngine(CountingStage(2, tick_s=0.03), admission_latency_s=limit_s)
        try:
            engine.open(1, None)
            c = run(engine, 1, list(range(LATENCY_MIN_FRAMES + 10)))
            assert c.errors == [None]
            if refused:
                with pytest.raises(ConversationError, match="at capacity: the 1 live conversations' frames"):
                    engine.open(2, None)
            else:
                engine.open(2, None)
        finally:
            engine.shutdown()


def test_admission_by_the_live_answers_leaves_out_a_newcomers_wait_for_its_prefill():
    """Frames sent while their conversation's prefill runs wait for it, not for a busy server:
    counted from its end, half a second of prefill refuses no one at a 100 ms limit."""
    from personaplex_triton.engine.scheduler import LATENCY_MIN_FRAMES

    stage = CountingStage(2, tick_s=0.01)
    engine = SlotEngine(stage, admission_latency_s=0.1)
    try:
        engine.open(1, "held")
        c = Collector()
        engine.submit(1, list(range(LATENCY_MIN_FRAMES + 10)), c.on_output, c.on_done)
        assert stage.holding.wait(5)
        time.sleep(0.5)
        stage.release.set()
        c.wait()
        assert c.errors == [None]
        engine.open(2, None)
    finally:
        engine.shutdown()


def test_a_tick_out_of_gpu_memory_keeps_the_live_conversations_and_refuses_newcomers():
    stage = FaultyStage(2)
    engine = SlotEngine(stage)
    try:
        engine.open(1, None)
        stage.faults = [torch.OutOfMemoryError("CUDA out of memory")]
        c = run(engine, 1, ["x", "y"])
        assert c.outputs == [("x", 1), ("y", 2)] and c.errors == [None]
        with pytest.raises(ConversationError, match="at capacity: a tick ran out of GPU memory"):
            engine.open(2, None)
    finally:
        engine.shutdown()


def test_while_the_sends_fall_behind_newcomers_are_refused_and_the_live_answers_all_arrive(monkeypatch):
    """A send that stalls (a host too busy to send in real time) holds the answers behind it: past
    SENDS_BEHIND_LIMIT_S a newcomer is refused with a clear reason, the heartbeat reports how far
    behind, and once the sends catch up every live frame is answered in order and newcomers are
    admitted again."""
    from personaplex_triton.engine import scheduler

    monkeypatch.setattr(scheduler, "SENDS_BEHIND_LIMIT_S", 0.1)

    class Behind(RecordingMetrics):
        def __init__(self):
            super().__init__()
            self.behind = []

        def sends_behind(self, seconds):
            self.behind.append(seconds)

    unstall = threading.Event()

    class StalledSender(Collector):
        def on_output(self, output, index, last):
            if index == 0:
                unstall.wait(10)
            super().on_output(output, index, last)

    metrics = Behind()
    engine = SlotEngine(CountingStage(3), metrics=metrics, admit_by_sends=True)
    try:
        engine.open(1, None)
        live = StalledSender()
        engine.submit(1, ["a", "b", "c"], live.on_output, live.on_done)
        assert wait_for(lambda: engine.sends_behind_s() > 0.1, every_s=0.05)
        with pytest.raises(ConversationError, match=r"at capacity: the answers leave \d+\.\d\d s after their ticks"):
            engine.open(2, None)
        assert wait_for(lambda: any(b > 0.1 for b in metrics.behind), every_s=0.05)
        unstall.set()
        live.wait()
        assert live.outputs == [("a", 1), ("b", 2), ("c", 3)] and live.errors == [None]
        assert engine.sends_behind_s() < 0.1
        engine.open(2, None)
        assert metrics.rejected_reasons == []  # a refused open is the caller's to count (the service's)
    finally:
        unstall.set()
        engine.shutdown()


def test_a_later_stage_s_sends_behind_refuse_newcomers_too(monkeypatch):
    """In one stub the talker's answers go on through code2wav's sends: its admission counts them."""
    downstream = [0.0]
    engine = SlotEngine(CountingStage(2), downstream_behind_s=lambda: downstream[0], admit_by_sends=True)
    try:
        engine.open(1, None)
        downstream[0] = 2.5
        with pytest.raises(ConversationError, match="at capacity: the answers leave 2.50 s after their ticks"):
            engine.open(2, None)
        downstream[0] = 0.0
        engine.open(2, None)
    finally:
        engine.shutdown()
    later = SlotEngine(CountingStage(2), downstream_behind_s=lambda: 2.5)
    try:
        later.open(1, None)  # by default (a later stage; a CPU's talker) the sends refuse no one
    finally:
        later.shutdown()


def test_in_two_stubs_the_talker_reads_code2wavs_backlog_from_what_its_stub_writes(tmp_path):
    """serving/sends_gauge.py: the talker's engine takes the gauge's reader as its later stage's backlog."""
    from personaplex_triton.serving.sends_gauge import SendsBehindWriter, sends_behind_reader

    server = os.getpid()
    code2wav = SendsBehindWriter("code2wav", "code2wav_0_0", server, tmp_path)
    engine = SlotEngine(CountingStage(3), downstream_behind_s=sends_behind_reader("code2wav", server, tmp_path),
                        admit_by_sends=True)
    try:
        code2wav.write(0.01)
        engine.open(1, None)
        code2wav.write(1.2)
        with pytest.raises(ConversationError, match="at capacity: the answers leave 1.20 s after their ticks"):
            engine.open(2, None)
        code2wav.write(0.0)  # caught up
        engine.open(2, None)
    finally:
        engine.shutdown()
        code2wav.close()

def test_tick_failing_twice_ends_its_conversations_and_the_engine_goes_on():
    stage = FaultyStage(2)
    engine = SlotEngine(stage)
    try:
        stage.faults = [RuntimeError("down"), RuntimeError("still down")]
        engine.open(1, None)
        hold_start(engine, 2)  # both conversations' items step in the failing tick
        a, b = Collector(), Collector()
        engine.submit(1, ["x"], a.on_output, a.on_done)
        engine.submit(2, ["y"], b.on_output, b.on_done)
        stage.release.set()
        a.wait(), b.wait()
        for c in (a, b):
            assert c.outputs == [] and "internal error while stepping: still down" in c.errors[0]
        assert not engine.is_open(1) and not engine.is_open(2)
        engine.open(3, None)
        assert run(engine, 3, ["z"]).outputs == [("z", 1)]
    finally:
        engine.shutdown()


def test_engine_that_cannot_go_on_errors_everything_and_says_so():
    stage = CountingStage(2, tick_s=0.01)
    metrics = RecordingMetrics()
    engine = SlotEngine(stage, metrics=metrics)
    engine.open(1, None)
    c = Collector()
    engine.submit(1, list(range(1000)), c.on_output, c.on_done)  # 10 s of ticks
    metrics.conversations = None  # the loop itself breaks (not a tick): TypeError as it counts the next start
    engine.open(2, None)
    c.wait()
    assert "the engine engine stopped" in c.errors[0]
    assert not engine.healthy and metrics.up[-1] is False
    with pytest.raises(ConversationError, match="engine stopped"):
        engine.open(2, None)
    engine.shutdown()


def test_injected_faults_from_the_environment(monkeypatch):
    monkeypatch.setenv("PERSONAPLEX_INJECT_FAULTS", "tick:1,send:2,flaky-tick:3")
    plan = FaultPlan.from_env()
    assert plan.faults == {1: "tick", 2: "send", 3: "flaky-tick"}
    engine = SlotEngine(CountingStage(4), faults=plan)
    try:
        for key in (1, 2, 3, 4):
            engine.open(key, None)
        collectors = {key: Collector() for key in (1, 2, 3, 4)}
        for key, c in collectors.items():
            engine.submit(key, ["a", "b"], c.on_output, c.on_done)
        for c in collectors.values():
            c.wait()
        assert "injected fault in conversation 1" in collectors[1].errors[0]
        assert "injected send fault" in collectors[2].errors[0]
        for key in (3, 4):  # the flaky tick was retried: nothing lost
            assert [x for x, _ in collectors[key].outputs] == ["a", "b"] and collectors[key].errors == [None]
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="not one of"):
        FaultPlan.parse("explode:1")


def test_idle_conversation_closed_after_timeout():
    engine = SlotEngine(CountingStage(1), idle_timeout_s=0.3)
    try:
        engine.open(1, None)
        run(engine, 1, ["a"])
        assert wait_for(lambda: not engine.is_open(1), 5, every_s=0.05)
        engine.open(2, None)  # its slot is free
    finally:
        engine.shutdown()


def test_cancelled_request_frees_its_slot():
    engine = SlotEngine(CountingStage(1, tick_s=0.01))
    try:
        engine.open(1, None)
        c, cancelled = Collector(), threading.Event()
        items = list(range(1000))  # 10 s of ticks
        engine.submit(1, items, c.on_output, c.on_done, is_cancelled=cancelled.is_set)
        cancelled.set()
        c.wait()
        assert c.errors == ["the request was cancelled"] and not engine.is_open(1)
        engine.open(2, None)
    finally:
        engine.shutdown()


def test_cancellation_polls_one_request_a_conversation():
    """Each poll is a round trip to tritonserver: with 20 requests pending, a conversation's
    oldest is asked, not all 20."""
    engine = SlotEngine(CountingStage(1, tick_s=0.01))
    try:
        engine.open(1, None)
        polls = []
        for i in range(20):  # 200 items each: the first is pending for 2 s of ticks
            c = Collector()
            engine.submit(1, [i] * 200, c.on_output, c.on_done,
                          is_cancelled=lambda i=i: polls.append(i) or False)
        time.sleep(1.3)  # two polls, CANCEL_POLL_S apart, once the requests are half a second old
        assert 1 <= len(polls) <= 3 and set(polls) == {0}
    finally:
        engine.shutdown(drain_s=0.1)


def test_a_failing_cancellation_poll_leaves_the_conversation_and_the_engine_running():
    """tritonserver's is_cancelled can raise (a request it already released): the conversation
    is answered in full and the engine stays healthy, where the loop used to die of it."""
    engine = SlotEngine(CountingStage(1, tick_s=0.01))
    try:
        engine.open(1, None)
        c = Collector()

        def broken():
            raise RuntimeError("the request is gone")
        engine.submit(1, list(range(100)), c.on_output, c.on_done, is_cancelled=broken)  # 1 s of ticks: polled
        c.wait()
        assert c.errors == [None] and len(c.outputs) == 100 and engine.healthy
    finally:
        engine.shutdown()


def test_shutdown_answers_every_pending_request():
    engine = SlotEngine(CountingStage(2, tick_s=0.01))
    engine.open(1, None)
    c = Collector()
    engine.submit(1, list(range(1000)), c.on_output, c.on_done)  # 10 s of ticks, past the drain
    started = time.monotonic()
    engine.shutdown(drain_s=0.5)
    assert c.errors == ["the server is shutting down"]
    assert time.monotonic() - started < 15  # the drain's bound, with room for a busy machine
    with pytest.raises(ConversationError, match="shutting down"):
        engine.open(2, None)


def test_frame_index_gap_ends_the_conversation(engine):
    engine.open(1, None)
    run(engine, 1, ["a"])
    with pytest.raises(ConversationError, match="frame 3 of conversation 1 arrived where frame 1 was due"):
        engine.submit(1, ["b"], lambda o, i, last: None, lambda e: None, first_index=3)
    assert not engine.is_open(1)


def test_empty_closing_request_waits_for_earlier_frames(engine):
    hold_start(engine, 1)  # "a" and "b" are still queued when the end request comes
    order = []
    engine.submit(1, ["a", "b"], lambda o, i, last: order.append(o[0]), lambda e: order.append("done a"))
    closer = Collector()
    engine.submit(1, [], None, lambda e: (order.append("closed"), closer.on_done(e)), close=True)
    engine.stage.release.set()
    closer.wait()
    assert order == ["a", "b", "done a", "closed"] and closer.errors == [None]


def test_draining_finishes_pending_requests_and_refuses_new_ones():
    """Shutdown lets a pending request finish in full; meanwhile a new conversation or a new
    request with items is refused, and an empty end request still ends its conversation."""

    class GatedStage(CountingStage):
        def __init__(self, num_slots):
            super().__init__(num_slots)
            self.gate = threading.Event()

        def tick(self, items):
            self.gate.wait(30)
            return super().tick(items)

    stage = GatedStage(2)
    engine = SlotEngine(stage)
    engine.open(1, None)
    pending, ended = Collector(), Collector()
    engine.submit(1, ["x", "y"], pending.on_output, pending.on_done)
    draining = threading.Thread(target=engine.shutdown, kwargs={"drain_s": 30})
    draining.start()
    deadline, refused = time.monotonic() + 10, None
    while refused is None and time.monotonic() < deadline:
        try:
            engine.open(2, None)  # admitted until the drain begins
            engine.submit(2, [], lambda o, i, last: None, lambda e: None, close=True)
        except ConversationError as exc:
            refused = str(exc)
    assert refused == "the server is shutting down; no new conversations"
    with pytest.raises(ConversationError, match="the server is shutting down; no new requests"):
        engine.submit(1, ["z"], pending.on_output, pending.on_done)
    engine.submit(1, [], None, ended.on_done, close=True)
    started = time.monotonic()
    stage.gate.set()
    draining.join(30)
    assert not draining.is_alive() and time.monotonic() - started < 10  # not the 30 s drain bound
    assert [o[0] for o in pending.outputs] == ["x", "y"] and pending.errors == [None]
    assert ended.errors == [None] and not engine.is_open(1)


def test_conversations_starting_count_as_prefilling():
    """A stage's start plays the persona's prefill: the prefilling gauge counts it meanwhile."""

    class Gauges(Metrics):
        def __init__(self):
            super().__init__()
            self.seen = []

        def conversations(self, active, prefilling):
            self.seen.append((active, prefilling))

    stage, gauges = CountingStage(2), Gauges()
    engine = SlotEngine(stage, metrics=gauges)
    try:
        hold_start(engine, 1)
        assert gauges.seen[-1] == (1, 1)
        stage.release.set()
        deadline = time.monotonic() + 10
        while gauges.seen[-1] != (1, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gauges.seen[-1] == (1, 0)
    finally:
        stage.release.set()
        engine.shutdown()


def test_a_delivery_that_breaks_errors_every_pending_request():
    """Answers leave from the outbox's thread; if delivering breaks where no send is to blame
    (here the metrics), every pending request gets an error and the engine reports unhealthy,
    as when its own loop dies: no request waits in silence."""

    class BrokenMetrics(Metrics):
        def frame_answered(self, latency_s):
            raise RuntimeError("metrics backend gone")

    engine = SlotEngine(CountingStage(2), metrics=BrokenMetrics())
    try:
        engine.open(1, None)
        c = run(engine, 1, ["x", "y"])
        assert c.errors and "answers stopped" in c.errors[0] and "metrics backend gone" in c.errors[0]
        assert not engine.healthy
    finally:
        engine.shutdown()


def test_send_threads_deliver_at_once_each_conversation_in_order():
    """With several send threads (the outbox's lanes) the answers of different conversations
    are in flight at once, while each conversation's leave in order and every request completes."""
    engine = SlotEngine(CountingStage(6), send_threads=3)
    in_flight, most, lock = [0], [0], threading.Lock()

    class SlowSender(Collector):
        def on_output(self, output, index, last):
            with lock:
                in_flight[0] += 1
                most[0] = max(most[0], in_flight[0])
            time.sleep(0.005)  # a send's round trip to tritonserver
            super().on_output(output, index, last)
            with lock:
                in_flight[0] -= 1

    try:
        collectors = {key: SlowSender() for key in range(6)}
        for key in collectors:
            engine.open(key, None)
        for key, c in collectors.items():
            engine.submit(key, list(range(20)), c.on_output, c.on_done)
        for c in collectors.values():
            c.wait()
        for c in collectors.values():
            assert [x for x, _ in c.outputs] == list(range(20)) and c.indices == list(range(20))
            assert c.errors == [None]
        assert most[0] >= 2
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="at least one lane"):
        SlotEngine(CountingStage(1), send_threads=0)


class ChunkedPrefillStage(CountingStage):
    """Prefills in chunks (`begin_prefills`), `chunk_s` each; a "broken" setup fails at its second
    chunk. `log` says what ran in order: ("chunk", slots), ("tick", slots), ("stop", slot)."""

    def __init__(self, num_slots, chunks=5, chunk_s=0.01):
        super().__init__(num_slots, tick_s=0.002)
        self.chunks, self.chunk_s, self.log = chunks, chunk_s, []

    def begin_prefills(self, setups):
        def chunks(failed):
            for i in range(self.chunks):
                self.log.append(("chunk", sorted(setups)))
                if i == 1 and "broken" in setups.values():
                    raise RuntimeError("broken persona")
                time.sleep(self.chunk_s)
                yield
            for slot in setups:
                self.seen[slot] = 0
        return PrefillJob(chunks)

    def tick(self, items):
        self.log.append(("tick", sorted(items)))
        return super().tick(items)

    def stop(self, slot):
        self.log.append(("stop", slot))


def test_a_prefill_in_chunks_lets_the_live_conversations_tick_between_them():
    """While a conversation is prefilled in chunks, the live one's frames tick between the chunks;
    the newcomer's frames wait for its prefill's last chunk, then all come, in order."""
    stage = ChunkedPrefillStage(2)
    engine = SlotEngine(stage)
    try:
        live, newcomer = live_conversation(engine, 40), Collector()
        engine.open(2, None)
        engine.submit(2, list(range(5)), newcomer.on_output, newcomer.on_done)
        live.wait(), newcomer.wait()
        assert [x for x, _ in live.outputs] == list(range(40)) and [x for x, _ in newcomer.outputs] == list(range(5))
        chunks = [i for i, entry in enumerate(stage.log) if entry == ("chunk", [1])]  # the newcomer's slot
        ticks_between = [slots for what, slots in stage.log[chunks[0]:chunks[-1]] if what == "tick"]
        assert len(chunks) == 5 and ticks_between and all(slots == [0] for slots in ticks_between)
        assert all(1 not in slots for what, slots in stage.log[:chunks[-1]] if what == "tick")
    finally:
        engine.shutdown()


def test_each_prefill_is_recorded_with_its_chunks(tmp_path, monkeypatch):
    """With the trace on, each prefill an engine ran is a record (trace.read_prefills): the
    conversations prefilled together, each chunk as the loop waited for it, within the whole."""
    from personaplex_triton.core import trace

    monkeypatch.setenv(trace.TRACE_DIR_ENV, str(tmp_path))
    stage = ChunkedPrefillStage(2, chunks=3, chunk_s=0.01)
    engine = SlotEngine(stage, name="talker")
    try:
        live = live_conversation(engine, 20)
        engine.open(2, None)
        assert run(engine, 2, ["x"]).outputs == [("x", 1)]
        live.wait()
    finally:
        engine.shutdown()
    first, second = trace.read_prefills(tmp_path, "talker")
    # the stage's 3 yields make 4 chunks: the loop's last call runs the work after the last yield
    assert (first.conversations, first.chunks, second.conversations, second.chunks, second.live) == (1, 4, 1, 4, 2)
    assert first.ended <= second.ended and sum(chunk >= 0.01 for chunk in second.chunks_s) == 3
    assert second.longest_chunk_s == max(second.chunks_s) and sum(second.chunks_s) <= second.duration_s
    assert trace.read_prefills(tmp_path, "code2wav") == [] and trace.read(tmp_path, "talker")  # frames apart


def test_a_prefill_that_fails_in_a_chunk_ends_its_conversation_only():
    """A chunk that raises fails the conversations of its prefill (those admitted with it), not
    the live ones."""
    stage = ChunkedPrefillStage(2)
    engine = SlotEngine(stage)
    try:
        engine.open(1, None)
        run(engine, 1, ["w"])
        engine.open(2, "broken")
        c = run(engine, 2, ["x"])
        assert c.outputs == [] and "could not start the conversation: broken persona" in c.errors[0]
        assert run(engine, 1, ["y"]).outputs == [("y", 2)]
    finally:
        engine.shutdown()


def test_a_conversation_closed_while_it_prefills_frees_its_slot_after_the_prefill():
    """Its slot is not freed (the stage's stop) while its prefill may still write into it."""
    stage = ChunkedPrefillStage(1, chunk_s=0.05)
    engine = SlotEngine(stage)
    try:
        engine.open(1, None)
        assert wait_for(lambda: stage.log, every_s=0.05)  # its prefill under way
        c = Collector()
        engine.submit(1, [], c.on_output, c.on_done, close=True)
        c.wait()
        deadline = time.monotonic() + 10
        while ("stop", 0) not in stage.log and time.monotonic() < deadline:
            time.sleep(0.01)
        chunks = [i for i, (what, _) in enumerate(stage.log) if what == "chunk"]
        assert len(chunks) == 5 and stage.log.index(("stop", 0)) > chunks[-1]  # conversation 2's come after
        engine.open(2, None)  # the slot is free again
        assert run(engine, 2, ["z"]).outputs == [("z", 1)]
    finally:
        engine.shutdown()


def test_prefills_under_way_take_turns_a_chunk_a_tick():
    """Two conversations prefilling at once (admitted in different passes): each pass runs one
    chunk of one of them, so a live conversation's tick waits for one chunk, never two."""
    stage = ChunkedPrefillStage(3, chunks=6, chunk_s=0.03)
    engine = SlotEngine(stage)
    try:
        live = live_conversation(engine, 300)
        engine.open(2, None)
        assert wait_for(lambda: ("chunk", [1]) in stage.log, every_s=0.05)
        engine.open(3, None)
        for key in (2, 3):
            assert run(engine, key, ["x"]).outputs == [("x", 1)]
        live.wait()
        entries = stage.log[stage.log.index(("chunk", [1])):]
        last = max(i for i, (what, _) in enumerate(entries) if what == "chunk")
        assert ("chunk", [1]) in entries and ("chunk", [2]) in entries
        assert not any(a[0] == b[0] == "chunk" for a, b in zip(entries[:last], entries[1:last + 1]))
    finally:
        engine.shutdown()


def test_a_drain_answers_a_conversation_whose_prefill_is_under_way():
    """Shutdown while a prefill runs in chunks: the prefill goes on to its end, then its pending
    frames are answered, within the drain."""
    stage = ChunkedPrefillStage(1, chunks=6, chunk_s=0.05)
    engine = SlotEngine(stage)
    engine.open(1, None)
    pending = Collector()
    engine.submit(1, ["a", "b"], pending.on_output, pending.on_done)
    assert wait_for(lambda: stage.log, every_s=0.05)  # its prefill under way
    engine.shutdown(drain_s=10)
    pending.wait()
    assert pending.outputs == [("a", 1), ("b", 2)] and pending.errors == [None]
    assert sum(entry == ("chunk", [0]) for entry in stage.log) == 6


class SpinOrSleepStage(CountingStage):
    """A tick of item "spin" keeps its thread on the CPU until it has had 60 ms of it, as a GPU
    wait spins (by its own CPU clock: on busy cores the wall time grows, not the CPU time); one
    of "sleep" waits 60 ms off it, as a tick waiting for the GIL does."""

    def tick(self, items):
        if "spin" in items.values():
            until = time.thread_time() + 0.06
            while time.thread_time() < until:
                pass
        else:
            time.sleep(0.06)
        return super().tick(items)


def test_the_frame_trace_keeps_the_ticks_cpu_time(tmp_path, monkeypatch):
    """Each frame's record holds its tick's wall time and the CPU time of the thread that ran
    it: the two match for a tick that spins, and a tick that sleeps shows its wait off the CPU."""
    from personaplex_triton.core import trace

    monkeypatch.setenv(trace.TRACE_DIR_ENV, str(tmp_path))
    engine = SlotEngine(SpinOrSleepStage(1), name="talker")
    try:
        engine.open(1, None)
        run(engine, 1, ["spin", "sleep"])
    finally:
        engine.shutdown()
    spin, sleep = trace.read(tmp_path, "talker")
    for record in (spin, sleep):
        assert record["tick_end"] - record["tick_start"] >= 0.06
    assert 0.06 <= spin["tick_cpu"] <= spin["tick_end"] - spin["tick_start"]  # the tick thread's own clock
    assert sleep["tick_cpu"] < 0.02


def test_a_prefills_later_chunks_wait_for_two_ticks_while_live_frames_wait_and_not_otherwise():
    """`chunk_spacing_ticks` 2 (the talker's): while a live conversation's frames wait, two of
    its ticks run between two chunks of a prefill (its first chunk at once, as before); with no
    live frames the chunks run one after another."""
    stage = ChunkedPrefillStage(2, chunks=5, chunk_s=0.005)
    engine = SlotEngine(stage, chunk_spacing_ticks=2)
    try:
        live = live_conversation(engine, 60)
        engine.open(2, None)
        assert run(engine, 2, ["x"]).outputs == [("x", 1)]
        live.wait()
        chunks = [i for i, entry in enumerate(stage.log) if entry == ("chunk", [1])]
        assert len(chunks) == 5
        between = [sum(what == "tick" for what, _ in stage.log[a + 1:b]) for a, b in zip(chunks, chunks[1:])]
        assert all(n >= 2 for n in between), between

        stage.log.clear()  # alone: nothing waits, so nothing spaces the chunks
        engine.submit(1, [], None, lambda _: None, close=True)
        assert wait_for(lambda: ("stop", 0) in stage.log, every_s=0.05)
        engine.open(3, None)
        assert run(engine, 3, ["y"]).outputs == [("y", 1)]
        chunks = [i for i, entry in enumerate(stage.log) if entry[0] == "chunk"]
        assert len(chunks) == 5 and chunks == list(range(chunks[0], chunks[0] + 5)), stage.log
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="between a prefill's chunks must be at least 1, got 0"):
        SlotEngine(CountingStage(1), chunk_spacing_ticks=0)
