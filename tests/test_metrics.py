"""The metric update queue between the serving threads and the reporter (metrics.py)."""

import threading

from personaplex_triton.core.metrics import UpdateQueue


def test_updates_are_coalesced_until_taken():
    updates = UpdateQueue()
    for _ in range(5):
        updates.increment(("frames", ()))
    updates.increment(("rejected", (("reason", "limit"),)), 2)
    updates.set(("active", ()), 3)
    updates.set(("active", ()), 4)
    updates.observe(("latency", ()), 0.1)
    updates.observe(("latency", ()), 0.2)
    counts, gauges, observed = updates.take()
    assert counts == {("frames", ()): 5, ("rejected", (("reason", "limit"),)): 2}
    assert gauges == {("active", ()): 4}  # a gauge's last value
    assert observed == [(("latency", ()), 0.1), (("latency", ()), 0.2)]  # every observation, in order
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
