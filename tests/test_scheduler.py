"""The engine's scheduler: what a tick carries and when it starts, the tick cost model and
admission by time (no stage, no server)."""

import pytest

from personaplex_triton.engine.conversations import ConversationTable, Request
from personaplex_triton.engine.scheduler import (FRAME_S, LATENCY_MIN_FRAMES, LATENCY_WINDOW_S, MEMORY_FULL_S, MODEL_MIN_TICKS,
                                                  Scheduler, TickModel)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def table_with(conversations: int) -> ConversationTable:
    table = ConversationTable(conversations)
    for key in range(conversations):
        table.admit(key, None, restart=False)
    table.take_prefilling()
    return table


def queue(table, key, clock, frames=1):
    """Queue `frames` items of conversation `key`, stamped now."""
    conv = table.conversation(key)
    before = len(conv.queue)
    table.enqueue(conv, Request(list(range(frames)), None, None), close=False, first_index=None)
    for i in range(before, len(conv.queue)):  # the table stamps the wall clock: this test's instead
        request, item, _ = conv.queue[i]
        conv.queue[i] = (request, item, clock())


def test_a_tick_carries_each_waiting_conversations_next_frame_at_once():
    clock = Clock()
    table = table_with(4)
    scheduler = Scheduler(table, clock=clock)
    assert scheduler.due_in() is None and scheduler.schedule() is None
    queue(table, 0, clock, frames=2)
    queue(table, 2, clock)
    assert scheduler.due_in() == 0
    plan = scheduler.schedule()
    assert sorted(plan.items) == [0, 2]
    assert [item for _, _, item, _ in plan.items.values()] == [0, 0]
    assert sorted(scheduler.schedule().items) == [0]  # the second frame, next tick
    assert scheduler.schedule() is None


def test_a_ticks_rows_and_so_its_answers_go_oldest_frame_first_whatever_the_join_order():
    """The plan's order is the order the tick's answers are sent in, one after another: the frame
    that waited longest goes first, not the conversation that joined first."""
    clock = Clock()
    table = table_with(4)
    scheduler = Scheduler(table, clock=clock)
    for key in (2, 0, 3):  # arrivals 1 ms apart; conversation 1 sends nothing
        queue(table, key, clock)
        clock.now += 0.001
    assert list(scheduler.schedule().items) == [2, 0, 3]
    queue(table, 1, clock)
    clock.now += 0.001
    queue(table, 0, clock)  # a later frame of an earlier conversation
    assert list(scheduler.schedule().items) == [1, 0]


def test_a_gathering_tick_waits_for_the_rest_of_the_oldest_frames_group_at_most_its_bound():
    """code2wav's way: items name their group (the talker tick that answered them) and its size;
    a tick waits until the oldest item's group is all there, or gather_max_s has passed."""
    clock = Clock()
    table = table_with(4)
    scheduler = Scheduler(table, gather=lambda item: item, gather_max_s=0.02, clock=clock)

    def arrive(key, group):
        conv = table.conversation(key)
        table.enqueue(conv, Request([group], None, None), close=False, first_index=None)
        request, item, _ = conv.queue[-1]
        conv.queue[-1] = (request, item, clock())

    arrive(0, (7, 3))
    clock.now += 0.0005
    arrive(1, (7, 3))
    assert scheduler.due_in() == pytest.approx(0.0195) and scheduler.schedule() is None
    clock.now += 0.0005
    arrive(2, (7, 3))  # the group is whole
    assert scheduler.due_in() == 0
    assert sorted(scheduler.schedule().items) == [0, 1, 2]
    arrive(3, (8, 2))  # its other frame never comes: the bound
    clock.now += 0.019
    assert scheduler.schedule() is None
    clock.now += 0.0011
    assert sorted(scheduler.schedule().items) == [3]
    arrive(0, None)  # an item of no group goes at once
    assert scheduler.due_in() == 0


def test_the_tick_model_fits_fixed_and_per_frame_cost():
    model = TickModel()
    assert model.fit() is None and model.steady_tick_s(10) is None
    for i in range(MODEL_MIN_TICKS):
        frames = 1 + i % 8
        model.add(frames, 0.012 + 0.0005 * frames)
    fixed, per_frame = model.fit()
    assert fixed == pytest.approx(0.012) and per_frame == pytest.approx(0.0005)
    n = 64
    assert model.steady_tick_s(n) == pytest.approx(0.012 / (1 - n * 0.0005 / FRAME_S))
    assert model.steady_tick_s(200) == float("inf")


def test_one_tick_size_only_tells_no_per_frame_cost():
    model = TickModel()
    for _ in range(MODEL_MIN_TICKS):
        model.add(1, 0.012)
    assert model.fit() == pytest.approx((0.012, 0.0))


def test_admission_refuses_a_conversation_that_would_make_the_live_ones_late():
    clock = Clock()
    scheduler = Scheduler(table_with(1), admission_tick_s=0.03, clock=clock)
    assert scheduler.admission_error(100) is None  # nothing measured yet
    for i in range(MODEL_MIN_TICKS):
        frames = 8 + i % 16
        scheduler.record(frames, 0.012 + 0.0005 * frames)
    # steady tick 12 / (1 - n * 0.5 / 80) ms: 30 ms at n = 96
    assert scheduler.admission_error(94) is None
    error = scheduler.admission_error(100)
    assert error.startswith("at capacity: 100 live conversations") and "30 ms" in error
    assert "cannot keep up" in scheduler.admission_error(200)
    assert Scheduler(table_with(1), clock=clock).admission_error(200) is None  # off by default


def test_a_tick_out_of_gpu_memory_refuses_newcomers_for_a_while():
    clock = Clock()
    scheduler = Scheduler(table_with(1), clock=clock)
    scheduler.out_of_memory()
    assert scheduler.admission_error(5).startswith("at capacity: a tick ran out of GPU memory")
    clock.now += MEMORY_FULL_S + 1
    assert scheduler.admission_error(5) is None


def test_admission_refuses_while_the_live_conversations_answers_come_late():
    clock, answers = Clock(), Clock()
    scheduler = Scheduler(table_with(1), admission_latency_s=0.065, clock=clock, latency_clock=answers)
    for _ in range(LATENCY_MIN_FRAMES - 1):
        scheduler.answered(0.2)
    assert scheduler.admission_error(10) is None  # too few answers for a verdict
    scheduler.answered(0.2)
    error = scheduler.admission_error(10)
    assert error.startswith("at capacity: the 10 live conversations' frames are answered in up to 200 ms")
    assert scheduler.admission_error(0) is None  # nobody live to protect
    answers.now += LATENCY_WINDOW_S + 0.1  # the late answers leave the window
    for _ in range(LATENCY_MIN_FRAMES * 2):
        scheduler.answered(0.03)
    assert scheduler.admission_error(10) is None
    scheduler.answered(0.5)  # one late frame of a hundred: p99 stays under the limit
    assert scheduler.admission_error(10) is None
    answers.now += LATENCY_WINDOW_S + 0.1
    scheduler.answered(0.03)
    assert len(scheduler.latencies) == 1  # what left the window is forgotten as answers come
    off = Scheduler(table_with(1), clock=clock, latency_clock=answers)
    for _ in range(LATENCY_MIN_FRAMES):
        off.answered(0.2)
    assert off.admission_error(10) is None and not len(off.latencies)  # off by default (the CPU's): nothing kept
