"""What the stages report for monitoring: the names, kinds and meanings of their metrics.

`Metrics` records nothing; `triton_adapter.TritonMetrics` puts the same calls on Triton's
Prometheus endpoint (`:8002/metrics`), each series labelled with the model's name, through an
`UpdateQueue`.

A histogram is kept here, as Prometheus exposes one: the counters `<name>_bucket` (label `le`,
cumulative), `<name>_sum` and `<name>_count`. A Python-backend model's every update is a round
trip to tritonserver, and Triton's own histogram takes one observation a call: hundreds a second
for the frame latency under load, which would keep the reporter thread busy most of the time.
As counters, a batch of observations is one increment a bucket.
"""

from __future__ import annotations

import bisect
import threading
import time
import urllib.request
from dataclasses import dataclass

# name: (kind, description); docs/reliability.md's "Metrics" lists the same.
FAMILIES = {
    "personaplex_conversations_active": ("gauge", "Conversations holding a slot"),
    "personaplex_conversations_prefilling": ("gauge", "Conversations still playing their persona prefill"),
    "personaplex_tick_duration_seconds": ("histogram", "Duration of one batched step over the slot pool"),
    "personaplex_tick_frames_total": ("counter", "Frames the ticks carried (over the ticks' count: frames per tick)"),
    "personaplex_frames_total": ("counter", "Frames answered"),
    "personaplex_frame_latency_seconds": ("histogram", "In-server latency of a frame: request arrival in the model to its response"),
    "personaplex_requests_rejected_total": ("counter", "Requests answered with an error, by reason"),
    "personaplex_persona_cache_lookups_total": ("counter", "Persona cache lookups at a conversation's start, by result (hit, miss)"),
    "personaplex_engine_up": ("gauge", "1 while the model's engine runs, 0 once it cannot go on"),
    "personaplex_engine_heartbeat_seconds": ("gauge", "Unix time of the engine loop's last pass (at least once a second)"),
    "personaplex_sends_behind_seconds": ("gauge", "How long the oldest answer not yet sent has waited (over 0.25 s on a GPU: new conversations are refused)"),
    "personaplex_gc_pause_seconds": ("histogram", "Python garbage collections in the model's process, by generation: every thread waits out each one"),
    # What the model took at load (Metrics.loaded; `stage_setups` reads them back).
    "personaplex_conversation_slots": ("gauge", "Conversation slots of the model's pool"),
    "personaplex_send_threads": ("gauge", "Threads sending the model's answers to Triton"),
    "personaplex_mimi_runtime": ("gauge", "1 for the runtime the model's half of Mimi runs on (labels part: encoder or decoder, runtime)"),
    "personaplex_persona_warm": ("gauge", "1 for each persona prefilled into the cache at load (label voice)"),
    "personaplex_kv_cache_dtype": ("gauge", "1 for the dtype the talker's KV cache stores (label dtype)"),
}
SECONDS_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24)
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")  # the counters a histogram is exposed as

# Labels of personaplex_requests_rejected_total.
INVALID_INPUT = "invalid_input"      # breaks the wire contract
LIMIT = "limit"                      # over one of the documented limits
NO_FREE_SLOT = "no_free_slot"       # every slot taken, or the tick model says one more would be late
NOT_OPEN = "not_open"                # no such conversation (never started, ended, or timed out)
LOST_FRAME = "lost_frame"            # a frame index out of order between the stages
CANCELLED = "cancelled"              # the client went away
INTERNAL = "internal"                # a failed step or send
UNAVAILABLE = "unavailable"          # shutting down, or the engine stopped


def scrape(metrics_url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """`name{labels}` -> value of every sample on a Prometheus endpoint (`host:port`)."""
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=timeout_s) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            samples[series] = float(value)
    return samples


@dataclass(frozen=True)
class StageSetup:
    """What a stage took at load, as its model's metrics say (Metrics.loaded)."""

    slots: int
    send_threads: int
    mimi_part: str                   # encoder (the talker's) or decoder (code2wav's)
    mimi_runtime: str                # tensorrt, onnxruntime or torch
    warm_personas: tuple[str, ...]   # the talker's; none for code2wav
    kv_dtype: str | None = None      # what the talker's KV cache stores; None for code2wav


def stage_setups(metrics_url: str, expect: tuple[str, ...] = (), wait_s: float = 5.0) -> dict[str, StageSetup]:
    """{model: its StageSetup} of every model on the endpoint (`host:port`) that has reported
    its load; read again for up to `wait_s` until each model of `expect` has (a model reports
    from a thread of its own, just after it is ready)."""
    deadline = time.monotonic() + wait_s
    while True:
        setups = _stage_setups(scrape(metrics_url))
        if set(expect) <= setups.keys() or time.monotonic() > deadline:
            return setups
        time.sleep(0.1)


def _stage_setups(samples: dict[str, float]) -> dict[str, StageSetup]:
    found: dict[str, dict] = {}
    for series, value in samples.items():
        name, labels = series.split("{", 1)[0], series_labels(series)
        if "model" not in labels:
            continue
        setup = found.setdefault(labels["model"], {"warm_personas": []})
        if name == "personaplex_conversation_slots":
            setup["slots"] = int(value)
        elif name == "personaplex_send_threads":
            setup["send_threads"] = int(value)
        elif name == "personaplex_mimi_runtime" and value:
            setup["mimi_part"], setup["mimi_runtime"] = labels["part"], labels["runtime"]
        elif name == "personaplex_persona_warm" and value:
            setup["warm_personas"].append(labels["voice"])
        elif name == "personaplex_kv_cache_dtype" and value:
            setup["kv_dtype"] = labels["dtype"]
    return {model: StageSetup(**{**setup, "warm_personas": tuple(sorted(setup["warm_personas"]))})
            for model, setup in found.items() if {"slots", "send_threads", "mimi_runtime"} <= setup.keys()}


def series_labels(series: str) -> dict[str, str]:
    """A sample's labels: `name{a="1",b="2"}` -> {"a": "1", "b": "2"} (none: {})."""
    if "{" not in series:
        return {}
    return dict(pair.split("=", 1) for pair in series[series.index("{") + 1:-1].replace('"', "").split(","))


def bucket_label(bound: float) -> str:
    """A bucket's `le` label, as Prometheus writes it."""
    return "+Inf" if bound == float("inf") else f"{bound:g}"


def histogram_counts(key, values, buckets=SECONDS_BUCKETS) -> dict:
    """The counter increments that observing `values` in histogram `key` (name, labels) makes:
    each bucket's cumulative count (label `le`: values at most its bound), the sum and the count."""
    name, labels = key
    first_bucket = [0] * (len(buckets) + 1)  # per value: the first bucket that holds it (+Inf last)
    for value in values:
        first_bucket[bisect.bisect_left(buckets, value)] += 1
    counts, inside = {}, 0
    for bound, new in zip((*buckets, float("inf")), first_bucket):
        inside += new
        if inside:
            counts[(name + "_bucket", (*labels, ("le", bucket_label(bound))))] = inside
    if values:
        counts[(name + "_sum", labels)] = float(sum(values))
        counts[(name + "_count", labels)] = len(values)
    return counts


class UpdateQueue:
    """Metric updates waiting for a reporter thread: counters summed, gauges at their last
    value, histogram observations turned into their counters' increments (histogram_counts)
    when taken, off the serving threads. A Python-backend model's every update is a round trip
    to tritonserver; made where they arise, two a frame, they took most of the time a tick's
    answers spent leaving under load. A series is a key: (name, labels)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._counts: dict = {}
        self._gauges: dict = {}
        self._observed: dict = {}  # histogram key: the values observed since the last take
        self._closed = False

    def increment(self, key, value: float = 1) -> None:
        with self._cond:
            self._wake_if_first()
            self._counts[key] = self._counts.get(key, 0) + value

    def set(self, key, value: float) -> None:
        with self._cond:
            self._gauges[key] = value
            self._cond.notify()

    def observe(self, key, value: float) -> None:
        with self._cond:
            self._wake_if_first()
            self._observed.setdefault(key, []).append(value)

    def _wake_if_first(self) -> None:
        """A counter or an observation wakes the reporter only when nothing was pending: later
        ones wait out the hold anyway, and a wake-up a frame cost the serving threads the GIL."""
        if not (self._counts or self._gauges or self._observed):
            self._cond.notify()

    def take(self, hold_s: float = 0.0):
        """Wait for updates: (counts, gauges) of everything queued, the histograms' observations
        among the counts, or None once closed with nothing left. Counters and observations are
        held up to `hold_s` after the first, so that more coalesce; a gauge is taken at once
        (the occupancy and the heartbeat are read as they change)."""
        with self._cond:
            while not (self._counts or self._gauges or self._observed or self._closed):
                self._cond.wait()
            until = time.monotonic() + hold_s
            while not (self._gauges or self._closed) and (left := until - time.monotonic()) > 0:
                self._cond.wait(left)
            if not (self._counts or self._gauges or self._observed):
                return None
            counts, gauges, observed = self._counts, self._gauges, self._observed
            self._counts, self._gauges, self._observed = {}, {}, {}
        for key, values in observed.items():
            for series, value in histogram_counts(key, values).items():
                counts[series] = counts.get(series, 0) + value
        return counts, gauges

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


class Metrics:
    """The calls an engine and its service make; this base records nothing."""

    def conversations(self, active: int, prefilling: int) -> None:
        pass

    def tick(self, seconds: float, frames: int) -> None:
        pass

    def frame_answered(self, latency_s: float) -> None:
        pass

    def rejected(self, reason: str) -> None:
        pass

    def persona_cache_lookup(self, hit: bool) -> None:
        pass

    def alive(self, up: bool) -> None:
        """The engine's heartbeat: `up` false once it cannot go on."""

    def sends_behind(self, seconds: float) -> None:
        """At each heartbeat: how long the oldest answer not yet sent has waited."""

    def loaded(self, slots: int, send_threads: int, mimi_part: str, mimi_runtime: str,
               warm_personas: list[str] | None = None, kv_dtype: str | None = None) -> None:
        """Once the model is loaded: its pool, its send threads, where its half of Mimi runs and,
        the talker's, the personas prefilled into its cache and its KV cache's dtype."""

    def close(self) -> None:
        """Report what is pending, then stop."""
