"""Graceful shutdown on Triton 2.51: what the launcher and the talker do on SIGTERM.

Triton counts each open sequence of a sequence-batched model as an inference in flight, and on
SIGTERM waits up to --exit-timeout-secs for none to be left before it unloads the models
(finalize()). An open conversation is an open sequence in the talker and in code2wav until its
client sends the end request or it is idle for max_sequence_idle_microseconds (60 s), and the
model cannot end it. When the wait runs out Triton "exits immediately" with the models loaded,
and 2.51 then crashes or hangs in exit() and can leave a stub process behind. Two more traps:
once stopping, Triton refuses the ensemble's requests to code2wav that carry the start flag
(every frame of a start request), and an ensemble request answered with an error while any of
its frames is still in code2wav never leaves Triton's count (2.51 ignores the steps that
complete after the error).

So the launcher does not pass SIGTERM on at once. It writes DRAIN_FILE (the server's gRPC
address) in the folder named by SHUTDOWN_DIR_ENV, and each talker instance (registered there
at load) drains: its engine refuses new conversations and new requests with an error naming the
shutdown (no frame of theirs is in code2wav), and answers the pending ones in full, for up to
DRAIN_S. It says so in the folder, and then ends every sequence it has seen open, in both
stages, with end requests of its own to the gRPC address, and keeps ending any opened later.
Once every talker has drained, or after DRAIN_S and a margin, the launcher sends tritonserver
SIGTERM: nothing is left in flight, and Triton unloads the models (finalize()) and exits with
0, unless a client still holds a gRPC stream open: 2.51 then waits for it without end when it
stops its endpoint, and the launcher ends that wait (launch.serve).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

SHUTDOWN_DIR_ENV = "PERSONAPLEX_SHUTDOWN_DIR"  # a folder of the launcher's, for the files below
DRAIN_FILE = "drain"          # written by the launcher on SIGTERM: the server's gRPC address
SERVING_SUFFIX = ".serving"      # <model instance>.serving: written at load, by both stages
DRAINED_SUFFIX = ".drained"      # <talker instance>.drained: written once its pending requests are answered
FINALIZED_SUFFIX = ".finalized"  # <model instance>.finalized: written at the end of finalize()
# Pending requests may finish this long: a request holds at most 125 frames (10 s of audio);
# the tiny checkpoint stepped 120 in 13 s on the loaded 2-core test machine. Past it they get
# an error.
DRAIN_S = 15.0
POLL_S = 0.2  # how often the talker looks for the drain file, and for sequences opened after the drain


class OpenSequences:
    """Triton sequences a model has seen start (or go on) and not end, by correlation id.

    Triton's idle reaper ends a sequence without telling the model, so one with no request for
    `forget_after_s` (more than the reaper waits) is forgotten: ending it again would be refused.
    """

    def __init__(self, forget_after_s: float):
        self.forget_after_s = forget_after_s
        self._last_seen: OrderedDict[int, float] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    def note(self, key: int, end: bool, now: float | None = None) -> None:
        """A request of sequence `key` reached the model (Triton refuses any other first
        request than a start, so a request that is not an end means the sequence is open)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if end:
                self._last_seen.pop(key, None)
            else:
                self._last_seen[key] = now
                self._last_seen.move_to_end(key)
            while self._last_seen and next(iter(self._last_seen.values())) < now - self.forget_after_s:
                self._last_seen.popitem(last=False)

    def take(self) -> list[int]:
        """The open sequences, forgotten from here on (their ending is the caller's)."""
        with self._lock:
            keys = list(self._last_seen)
            self._last_seen.clear()
        return keys


def end_sequences(url: str, requests: list[tuple[str, int, dict]], timeout_s: float = 10.0) -> None:
    """Send each (model, correlation id, inputs) as a sequence-end request to the server at `url`
    over gRPC, on one stream, and wait for every answer (the stream's close would cancel them).

    Triton frees a sequence when it schedules its end request, whatever the model answers (a
    drained talker refuses it). Over gRPC because Triton 2.51 refuses a model's own requests
    (BLS) once it is shutting down, while its gRPC endpoint stays open until the models are
    unloaded."""
    import queue

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(lambda result, error: answers.put(error))
    try:
        for model, key, arrays in requests:
            inputs = []
            for name, value in arrays.items():
                tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
                tensor.set_data_from_numpy(value)
                inputs.append(tensor)
            client.async_stream_infer(model, inputs, sequence_id=key, sequence_end=True,
                                      enable_empty_final_response=True)
        deadline = time.monotonic() + timeout_s
        for _ in requests:  # each is answered by an error or a final response (these carry no frame)
            answers.get(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        client.stop_stream()
        client.close()


def write_atomically(path: Path, text: str) -> None:
    """So that a reader never sees the file empty or half written."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    part.rename(path)


def _mark(instance: str, suffix: str, text: str = "") -> None:
    folder = os.environ.get(SHUTDOWN_DIR_ENV)
    if folder:
        write_atomically(Path(folder) / (instance + suffix), text)


def register(instance: str, drains: bool) -> None:
    """A model instance loaded, in this (stub) process: while the process lives, the launcher
    waits for its finalize, and for its drain if it `drains`."""
    _mark(instance, SERVING_SUFFIX, f"{os.getpid()} {'drains' if drains else 'finalizes'}")


def mark_finalized(instance: str) -> None:
    _mark(instance, FINALIZED_SUFFIX)


def _alive(pid: int) -> bool:
    """Running, not a zombie (a killed stub stays one while tritonserver does not reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def drained(folder: Path) -> bool:
    """Whether every talker instance registered in `folder` has drained, or its process died."""
    done = {p.name.removesuffix(DRAINED_SUFFIX) for p in folder.glob("*" + DRAINED_SUFFIX)}
    for path in folder.glob("*" + SERVING_SUFFIX):
        pid, role = path.read_text().split()
        if role == "drains" and _alive(int(pid)) and path.name.removesuffix(SERVING_SUFFIX) not in done:
            return False
    return True


def not_finalized(folder: Path) -> list[str]:
    """The model instances registered in `folder` that have not finished their finalize()."""
    done = {p.name.removesuffix(FINALIZED_SUFFIX) for p in folder.glob("*" + FINALIZED_SUFFIX)}
    return sorted(name for name in (p.name.removesuffix(SERVING_SUFFIX) for p in folder.glob("*" + SERVING_SUFFIX))
                  if name not in done)


class Drain:
    """A talker instance's part: waits for the drain file in `folder`; then calls
    `drain(DRAIN_S)`, says so, and ends every open sequence, and each one opened later, until
    `stop()`: `end_requests(key)` says which requests end sequence `key`, sent to the gRPC
    address that the file holds. Without a folder (a tritonserver not started by the launcher)
    it does nothing."""

    def __init__(self, sequences: OpenSequences, drain: Callable[[float], None],
                 end_requests: Callable[[int], list[tuple[str, dict]]], instance: str, folder: str | None = None):
        self.sequences = sequences
        self._drain = drain
        self._end_requests = end_requests
        self._instance = instance
        self._folder = Path(folder) if folder else None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drain", daemon=True)
        if self._folder is not None:
            self._thread.start()

    @classmethod
    def from_env(cls, sequences: OpenSequences, drain, end_requests, instance: str) -> "Drain":
        return cls(sequences, drain, end_requests, instance, os.environ.get(SHUTDOWN_DIR_ENV))

    def _run(self) -> None:
        drain_file = self._folder / DRAIN_FILE
        while not drain_file.exists():
            if self._stopped.wait(POLL_S):
                return
        url = drain_file.read_text().strip()
        self._drain(DRAIN_S)
        (self._folder / (self._instance + DRAINED_SUFFIX)).touch()
        while True:
            requests = [(model, key, arrays) for key in self.sequences.take()
                        for model, arrays in self._end_requests(key)]
            if requests:
                try:
                    end_sequences(url, requests)
                except Exception:  # Triton's exit timeout bounds what is left open
                    log.exception("ending %d sequences failed", len(requests))
            if self._stopped.wait(POLL_S):
                return

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
