"""The metric update queue between the serving threads and the reporter (metrics.py)."""

import threading

from personaplex_triton.core.metrics import UpdateQueue, histogram_counts


def test_updates_are_coalesced_until_taken():
    updates = UpdateQueue()
    for _ in range(5):
        updates.increment(("frames", ()))
    updates.increment(("rejected", (("reason", "limit"),)), 2)
    updates.set(("active", ()), 3)
    updates.set(("active", ()), 4)
    updates.observe(("latency", ()), 0.1)
    updates.observe(("latency", ()), 0.2)
    counts, gauges = updates.take()
    assert {k: v for k, v in counts.items() if not k[0].startswith("latency")} == {
        ("frames", ()): 5, ("rejected", (("reason", "limit"),)): 2}
    assert gauges == {("active", ()): 4}  # a gauge's last value
    assert counts[("latency_count", ())] == 2 and abs(counts[("latency_sum", ())] - 0.3) < 1e-12
    updates.increment(("frames", ()))
    assert updates.take()[0] == {("frames", ()): 1}  # counted again from zero


def test_take_waits_for_updates_and_ends_after_close():
    updates, taken = UpdateQueue(), []

    def reporter():
        while (batch := updates.take()) is not None:
            taken.append(batch)

    thread = threading.Thread(target=reporter)
    thread.start()
    updates.set(("up", ()), 1)
    updates.close()  # what is pending is still taken, then the reporter stops
    thread.join(5)
    assert not thread.is_alive()
    assert sum(batch[1].get(("up", ()), 0) for batch in taken) == 1


def test_a_histogram_is_its_cumulative_bucket_counters_and_sum_and_count():
    key = ("latency", (("model", "talker"),))
    counts = histogram_counts(key, [0.004, 0.005, 0.03, 0.5, 20.0], buckets=(0.005, 0.01, 0.04, 1.0))
    bucket = lambda le: counts.get(("latency_bucket", (("model", "talker"), ("le", le))))
    # le is "at most": 0.005 falls in the 0.005 bucket; 20 s only in +Inf
    assert [bucket(le) for le in ("0.005", "0.01", "0.04", "1", "+Inf")] == [2, 2, 3, 4, 5]
    assert counts[("latency_count", (("model", "talker"),))] == 5
    assert abs(counts[("latency_sum", (("model", "talker"),))] - 20.539) < 1e-9
    assert histogram_counts(key, []) == {}
    # buckets below every value are left out (an increment of 0 is a round trip for nothing)
    assert bucket("0.005") is not None and histogram_counts(key, [2.0], buckets=(0.005, 1.0, 4.0)) == {
        ("latency_bucket", (("model", "talker"), ("le", "4"))): 1,
        ("latency_bucket", (("model", "talker"), ("le", "+Inf"))): 1,
        ("latency_sum", (("model", "talker"),)): 2.0, ("latency_count", (("model", "talker"),)): 1}


def test_observations_taken_in_batches_add_up_as_one():
    """The reporter takes whatever is queued: the counters of two batches sum to those of one."""
    key, values = ("tick", ()), [0.003, 0.012, 0.07, 0.3, 0.011, 0.09]
    whole, split = UpdateQueue(), UpdateQueue()
    for v in values:
        whole.observe(key, v)
    totals = {}
    for batch in (values[:2], values[2:]):
        for v in batch:
            split.observe(key, v)
        for series, n in split.take()[0].items():
            totals[series] = totals.get(series, 0) + n
    expected = whole.take()[0]
    assert totals.keys() == expected.keys()
    assert all(abs(totals[k] - expected[k]) < 1e-12 for k in expected)


def test_counters_are_held_to_coalesce_but_a_gauge_is_taken_at_once():
    import time

    updates = UpdateQueue()
    updates.increment(("frames", ()))
    threading.Timer(0.05, updates.increment, (("frames", ()),)).start()
    started = time.monotonic()
    counts, gauges = updates.take(hold_s=0.3)
    assert counts == {("frames", ()): 2} and gauges == {}  # the second came while the first was held
    assert time.monotonic() - started >= 0.29
    updates.increment(("frames", ()))
    threading.Timer(0.05, updates.set, (("active", ()), 1)).start()
    started = time.monotonic()
    counts, gauges = updates.take(hold_s=5.0)
    assert counts == {("frames", ()): 1} and gauges == {("active", ()): 1}
    assert time.monotonic() - started < 2.0  # the gauge ended the hold


def test_a_burst_of_counters_wakes_the_reporter_once():
    """Counters and observations wake the reporter only when nothing was pending (the rest wait
    out its hold); a gauge always does."""
    updates, wakes = UpdateQueue(), []
    notify = updates._cond.notify
    updates._cond.notify = lambda *args: (wakes.append(1), notify(*args))
    for _ in range(100):
        updates.increment(("frames", ()))
        updates.observe(("latency", ()), 0.01)
    assert len(wakes) == 1
    updates.set(("active", ()), 3)
    assert len(wakes) == 2
    updates.take()
    updates.observe(("latency", ()), 0.01)
    assert len(wakes) == 3  # the first after a take wakes it again
