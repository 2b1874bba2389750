"""The slot engine's scheduling, on a small arithmetic stage (no model needed)."""

import threading

import pytest

from personaplex_triton.engine import ConversationError, SlotEngine


class CountingStage:
    """Each slot answers item x with (x, how many items the slot has seen, batch size).
    A setup of "prefill:N" makes the slot tick N times without items first."""

    def __init__(self, num_slots):
        self.num_slots = num_slots
        self.seen = [0] * num_slots
        self.prefill = [0] * num_slots
        self.fail_on = None
        self.batch_sizes = []

    def start(self, slot, setup):
        if setup == "bad":
            raise ValueError("bad setup")
        self.seen[slot] = 0
        self.prefill[slot] = int(setup.split(":")[1]) if setup and setup.startswith("prefill:") else 0

    def stop(self, slot):
        self.prefill[slot] = 0

    def prefilling(self, slot):
        return self.prefill[slot] > 0

    def tick(self, items):
        for slot in range(self.num_slots):
            if self.prefill[slot] > 0:
                self.prefill[slot] -= 1
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
        self.outputs, self.indices, self.errors = [], [], []
        self.done = threading.Event()

    def on_output(self, output, index):
        self.outputs.append(output)
        self.indices.append(index)

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


def run(engine, key, items, close=False):
    c = Collector()
    engine.submit(key, items, c.on_output, c.on_done, close=close)
    c.wait()
    return c


def test_items_answered_once_each_in_order(engine):
    engine.open(1, None)
    c = run(engine, 1, list(range(5)))
    assert c.outputs == [(i, i + 1) for i in range(5)]
    assert c.errors == [None]
    c = run(engine, 1, [10, 11])
    assert c.outputs == [(10, 6), (11, 7)]
    assert c.indices == [5, 6]  # counted over the whole conversation


def test_conversations_share_ticks(engine):
    engine.open(1, "prefill:3")  # gives the other conversation time to queue up too
    engine.open(2, "prefill:3")
    a, b = Collector(), Collector()
    engine.submit(1, list(range(20)), a.on_output, a.on_done)
    engine.submit(2, list(range(20)), b.on_output, b.on_done)
    a.wait(), b.wait()
    assert [x for x, _ in a.outputs] == list(range(20)) == [x for x, _ in b.outputs]
    assert max(engine.stage.batch_sizes) == 2


def test_prefill_ticks_before_items(engine):
    engine.open(1, "prefill:4")
    c = run(engine, 1, ["a"])
    assert c.outputs == [("a", 1)]
    assert engine.stage.prefill[0] == 0 and engine.stage.prefill[1] == 0


def test_slot_limit_and_release(engine):
    engine.open(1, None)
    engine.open(2, None)
    with pytest.raises(ConversationError, match="slots are busy"):
        engine.open(3, None)
    with pytest.raises(ConversationError, match="already open"):
        engine.open(1, None)
    run(engine, 1, [1], close=True)
    with pytest.raises(ConversationError, match="not open"):
        engine.submit(1, [2], lambda o, i: None, lambda e: None)
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
