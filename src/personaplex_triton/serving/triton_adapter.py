"""The little that needs `triton_python_backend_utils`: tensors in and out of a request.

Importable only inside Triton's Python backend stub, which provides that module.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from ..core.collector import PauseWatch, freeze_loaded
from ..core.metrics import FAMILIES, HISTOGRAM_SERIES, Metrics, UpdateQueue, histogram_counts
from .sends_gauge import SendsBehindWriter
from .shutdown import Drain, OpenSequences, mark_finalized, register

SEQUENCE_START = 1  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
SEQUENCE_END = 2    # TRITONSERVER_REQUEST_FLAG_SEQUENCE_END


def log_info(message: str) -> None:
    """Into tritonserver's log (shown with --log-info, the default)."""
    pb_utils.Logger.log_info(message)


class TritonLogHandler(logging.Handler):
    """The library's log records into tritonserver's log, at their level. The stub gives Python's
    logging no handler: the library's INFO records (a conversation closed for idling, or
    cancelled; how long a start held the ticks) were lost, and its warnings reached stderr bare."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            if record.levelno >= logging.ERROR:
                pb_utils.Logger.log_error(message)
            elif record.levelno >= logging.WARNING:
                pb_utils.Logger.log_warn(message)
            else:
                pb_utils.Logger.log_info(message)
        except Exception:
            self.handleError(record)


def route_library_logs() -> None:
    """Send the `personaplex_triton` loggers' records (INFO and up) to tritonserver's log, once
    per stub process."""
    library = logging.getLogger("personaplex_triton")
    if not any(isinstance(handler, TritonLogHandler) for handler in library.handlers):
        library.addHandler(TritonLogHandler())
        library.setLevel(logging.INFO)


def request_arrays(request, names) -> dict[str, np.ndarray]:
    """The request's inputs among `names`, in one pass (get_input_tensor_by_name walks them all
    for each name)."""
    wanted = set(names)
    return {tensor.name(): tensor.as_numpy() for tensor in request.inputs() if tensor.name() in wanted}


def sequence_idle_s(args: dict) -> float:
    """The model's max_sequence_idle_microseconds, in seconds: Triton's reaper ends a sequence
    idle that long (Triton's default, 1 s, where the config leaves it out)."""
    batching = json.loads(args["model_config"]).get("sequence_batching", {})
    return int(batching.get("max_sequence_idle_microseconds", 1_000_000)) / 1e6


def sequence_flags(request) -> tuple[bool, bool]:
    flags = request.flags()
    return bool(flags & SEQUENCE_START), bool(flags & SEQUENCE_END)


def responder(request):
    """(send, finish, is_cancelled) for a decoupled request: a response per call of send, the
    last one (`last`) flagged FINAL, else FINAL alone at finish; is_cancelled says whether
    Triton cancelled the request (its client went away)."""
    sender = request.get_response_sender()
    completed = False

    def send(outputs: dict[str, np.ndarray], last: bool) -> None:
        nonlocal completed
        response = pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for name, value in outputs.items()])
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0)
        completed = last

    def finish(error: str | None) -> None:
        if completed:  # the last frame's response completed the request
            return
        if error is not None:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(error)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    return send, finish, sender.is_cancelled


def loaded(instance: str) -> None:
    """The last step of a model's `initialize`: what loading made lives as long as the stub, so
    it is frozen out of the garbage collector's walks (core/collector.py)."""
    log_info(f"{instance}: loaded; {freeze_loaded()} objects frozen out of the garbage collector's walks")


class ConversationModel:
    """The base of a model that takes the clients' conversations (the talker, `speech`): notes
    each sequence and hands each request's inputs to its service's `handle`; at shutdown drains
    the service, then ends the open sequences with the requests `end_requests(key)` names
    ((model, inputs) pairs, shutdown.Drain); at finalize closes the service. A subclass's
    `initialize` builds the service and calls `serve_conversations`."""

    def serve_conversations(self, args: dict, service, inputs) -> None:
        self.service, self.inputs = service, inputs
        self.name, self.instance = args["model_name"], args["model_instance_name"]
        # A sequence idle for twice the reaper's wait has been ended by it, without a word to us.
        self.sequences = OpenSequences(forget_after_s=2 * sequence_idle_s(args))
        self.drain = Drain.from_env(self.sequences, self._drain, self.end_requests, self.instance)
        register(self.instance, drains=True)
        loaded(self.instance)

    def end_requests(self, key: int) -> list[tuple[str, dict]]:
        raise NotImplementedError

    def execute(self, requests):
        for request in requests:
            start, end = sequence_flags(request)
            self.sequences.note(int(request.correlation_id()), end)
            send, finish, is_cancelled = responder(request)
            if start:  # which instance holds the conversation: several run with instance_group count > 1
                log_info(f"{self.instance}: conversation {request.correlation_id()} starts")
            self.service.handle(int(request.correlation_id()), start, end,
                                request_arrays(request, self.inputs), send, finish, is_cancelled)
        return None

    def _drain(self, drain_s: float) -> None:
        log_info(f"{self.instance}: shutting down: no new conversations or requests; answering the pending ones")
        self.service.drain(drain_s)
        log_info(f"{self.instance}: drained; ending the open sequences")

    def finalize(self) -> None:
        self.drain.stop()
        self.service.close()
        mark_finalized(self.instance)


REPORT_HOLD_S = 0.5  # counters wait this long for more to coalesce; gauges go at once


class TritonMetrics(Metrics):
    """The library's metrics (metrics.py) as Triton custom metrics, labelled with the model.
    Calls only queue their update; one thread of its own makes the round trips to tritonserver,
    the counters' in batches of up to REPORT_HOLD_S (a few dozen round trips, whatever the load).
    `sends_gauge`: where the heartbeat's backlog goes for the other stubs too (sends_gauge.py)."""

    def __init__(self, model: str, sends_gauge: SendsBehindWriter | None = None):
        # pb_utils.MetricFamily exists once the stub runs a model, not when this module is imported.
        family = pb_utils.MetricFamily
        kinds = {"gauge": family.GAUGE, "counter": family.COUNTER}
        self.model = model
        self._sends_gauge = sends_gauge
        self._families = {}
        for name, (kind, text) in FAMILIES.items():
            if kind == "histogram":  # as its counters (metrics.py)
                for suffix in HISTOGRAM_SERIES:
                    self._families[name + suffix] = family(name=name + suffix, description=f"{text} ({suffix[1:]})",
                                                           kind=family.COUNTER)
            else:
                self._families[name] = family(name=name, description=text, kind=kinds[kind])
        self._series: dict[tuple, object] = {}
        self._updates = UpdateQueue()
        self._collections = PauseWatch()  # the process's garbage collections, reported with the rest
        self._reporter = threading.Thread(target=self._report, name=f"{model}-metrics", daemon=True)
        self._reporter.start()
        self.alive(True)

    def _metric(self, key: tuple):
        name, labels = key
        if key not in self._series:
            self._series[key] = self._families[name].Metric(labels={"model": self.model, **dict(labels)})
        return self._series[key]

    def _report(self) -> None:
        while (taken := self._updates.take(REPORT_HOLD_S)) is not None:
            counts, gauges = taken
            for generation, pauses in self._collections.take().items():
                key = ("personaplex_gc_pause_seconds", (("generation", str(generation)),))
                for series, value in histogram_counts(key, pauses).items():
                    counts[series] = counts.get(series, 0) + value
            updates = [*((key, "increment", v) for key, v in counts.items()),
                       *((key, "set", v) for key, v in gauges.items())]
            for key, how, value in updates:
                try:  # each on its own: one that fails does not drop the rest of the batch
                    getattr(self._metric(key), how)(value)
                except Exception as exc:  # a metric must never take serving down
                    log_info(f"{self.model}: reporting {key[0]} failed: {exc}")

    def conversations(self, active: int, prefilling: int) -> None:
        self._updates.set(("personaplex_conversations_active", ()), active)
        self._updates.set(("personaplex_conversations_prefilling", ()), prefilling)

    def tick(self, seconds: float, frames: int) -> None:
        self._updates.observe(("personaplex_tick_duration_seconds", ()), seconds)
        self._updates.increment(("personaplex_tick_frames_total", ()), frames)

    def frame_answered(self, latency_s: float) -> None:
        self._updates.increment(("personaplex_frames_total", ()))
        self._updates.observe(("personaplex_frame_latency_seconds", ()), latency_s)

    def rejected(self, reason: str) -> None:
        self._updates.increment(("personaplex_requests_rejected_total", (("reason", reason),)))

    def persona_cache_lookup(self, hit: bool) -> None:
        self._updates.increment(("personaplex_persona_cache_lookups_total", (("result", "hit" if hit else "miss"),)))

    def alive(self, up: bool) -> None:
        self._updates.set(("personaplex_engine_up", ()), 1 if up else 0)
        self._updates.set(("personaplex_engine_heartbeat_seconds", ()), time.time())

    def sends_behind(self, seconds: float) -> None:
        self._updates.set(("personaplex_sends_behind_seconds", ()), seconds)
        if self._sends_gauge is not None:
            self._sends_gauge.write(seconds)

    def loaded(self, slots: int, send_threads: int, mimi_part: str, mimi_runtime: str,
               warm_personas: list[str] | None = None, kv_dtype: str | None = None) -> None:
        self._updates.set(("personaplex_conversation_slots", ()), slots)
        self._updates.set(("personaplex_send_threads", ()), send_threads)
        self._updates.set(("personaplex_mimi_runtime", (("part", mimi_part), ("runtime", mimi_runtime))), 1)
        for voice in warm_personas or ():
            self._updates.set(("personaplex_persona_warm", (("voice", voice),)), 1)
        if kv_dtype is not None:
            self._updates.set(("personaplex_kv_cache_dtype", (("dtype", kv_dtype),)), 1)

    def close(self) -> None:
        if self._sends_gauge is not None:
            self._sends_gauge.close()
        self._collections.close()
        self._updates.close()
        self._reporter.join(timeout=5)
