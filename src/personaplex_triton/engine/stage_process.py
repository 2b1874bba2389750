"""A stage in a process of its own: its ticks and prefills take that process's GIL, not the stub's.

In one Triton stub the tick's host work (building the step, launching its graph, reading its
result) shares one GIL with the stub's request and send threads, and under load the tick
spends a good part of its time waiting for it, more with more send threads (the measurements
are in docs/decisions.md). As vLLM runs its engine core apart from its API server,
`StageProcess` runs the stage (the model, its state, its CUDA context) in a child Python
process, and is the engine's stage (stage.Stage) in the stub: the scheduler, the conversations
and the sends stay in the stub, and a tick is one round trip through a pipe (the frames in,
the answers out, pickled). The stub then never touches the GPU.

Calls come from the engine's loop (tick, prefills) and, for `stop`, from any of its threads under
the engine's lock: `stop` is sent without waiting for an answer, and the child runs every
message in the order sent, so a stop is done before the next prefill of that slot. What the
stage reports on the side (`emit(name, *args)`, e.g. a persona cache lookup) comes back with
the next answer and goes to `on_event`. If the child dies, every later call raises
`StageProcessDied`, which stops the engine: its requests get the error and its health fails
(between ticks, the engine's heartbeat asks `raise_if_dead`).
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any, Callable

from .stage import Stage

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30.0  # the child closes its stage (its graphs, its encoder thread) within this


class StageProcessDied(RuntimeError):
    """The stage's process is gone: nothing it held can be used again."""


def python_executable() -> str:
    """The Python to run the child with. In a Triton stub `sys.executable` is the stub binary;
    the launcher puts the server's Python first on PATH as `python3` (launch.py)."""
    if Path(sys.executable or "").name.startswith("python"):
        return sys.executable
    found = shutil.which("python3")
    if found is None:
        raise RuntimeError("no python3 on PATH to run a stage's process")
    return found


class RemotePrefillJob:
    """A prefill under way in the child (prefills.PrefillJob's interface)."""

    def __init__(self, process: "StageProcess", job: int):
        self._process = process
        self._job = job
        self.failed: dict[int, Exception] = {}

    def advance(self) -> bool:
        done, failed = self._process._call("advance", self._job)
        self.failed.update(failed)
        return done


class StageProcess(Stage):
    def __init__(self, name: str, build: Callable[..., tuple[Any, Any]], options: dict,
                 on_event: Callable[..., None] = lambda name, *args: None):
        """Start a child that runs `build(**options, emit=...)` -> (stage, info), a module-level
        function (pickled by reference); returns once the stage is built (its model loaded,
        its graphs captured). `info` is kept as `self.info`; `on_event(name, *args)` gets what
        the stage emits."""
        self.name = name
        self._on_event = on_event
        self._send_lock = threading.Lock()
        self._call_lock = threading.Lock()  # one call and its answer at a time (the loop's; `close`)
        self._died: str | None = None
        self.last_tick_cpu_s = 0.0  # the child's CPU time in the last tick (the tick's trace)
        self.last_tick_split: float | None = None  # the stage's own, where it has one (stages/one_tick.py)
        self._conn, child = Pipe(duplex=True)
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        self._process = subprocess.Popen(
            [python_executable(), "-c", "from personaplex_triton.engine.stage_process import main; main()",
             name, str(child.fileno())], pass_fds=[child.fileno()], env=env)
        child.close()
        self._post(("build", build, options))
        try:
            self.num_slots, self.info = self._answer()
        except BaseException:  # a child whose build failed has exited: reap it
            self._process.wait(CLOSE_TIMEOUT_S)
            self._conn.close()
            raise
        log.info("%s: the stage runs in process %d", name, self._process.pid)

    @property
    def pid(self) -> int:
        return self._process.pid

    # -- engine.Stage ------------------------------------------------------------------------
    def tick(self, items: dict[int, Any]) -> dict[int, Any]:
        outputs, self.last_tick_cpu_s, self.last_tick_split = self._call("tick", items)
        return outputs

    def prefill_many(self, setups: dict[int, Any]) -> dict[int, Exception]:
        return self._call("prefill_many", setups)

    def begin_prefills(self, setups: dict[int, Any]) -> RemotePrefillJob:
        return RemotePrefillJob(self, self._call("begin_prefills", setups))

    def stop(self, slot: int) -> None:
        """Sent without waiting (the engine calls it under its lock, from any thread). A dead
        child holds nothing to stop: the next tick or heartbeat reports the death."""
        try:
            self._post(("stop", slot))
        except StageProcessDied:
            pass

    def close(self) -> None:
        if self._died is None:
            try:
                self._call("close")
            except StageProcessDied:
                pass
        try:
            self._process.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._conn.close()

    # -- the pipe ----------------------------------------------------------------------------
    def _call(self, op: str, *args):
        with self._call_lock:
            self._post((op, *args))
            return self._answer()

    def _post(self, message: tuple) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._raise_if_died()
            try:
                self._conn.send_bytes(payload)
            except OSError as exc:
                self._die(exc)

    def _answer(self):
        """The child's answer to the last call (under the call lock)."""
        self._raise_if_died()
        try:
            ok, value, events = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            self._die(exc)
        for event in events:
            self._on_event(*event)
        if not ok:
            raise value
        return value

    def _die(self, exc: Exception):
        try:
            status = self._process.wait(5)
        except subprocess.TimeoutExpired:
            status = None
        raise self._gone(f"exit status {status}: {exc!r}")

    def _raise_if_died(self) -> None:
        if self._died is not None:
            raise StageProcessDied(self._died)

    def raise_if_dead(self) -> None:
        """StageProcessDied if the child has exited: the engine's heartbeat asks, so that a
        child that dies between ticks fails the health check at once."""
        self._raise_if_died()
        status = self._process.poll()
        if status is not None:
            raise self._gone(f"exit status {status}")

    def _gone(self, how: str) -> StageProcessDied:
        """The child is gone: every later call raises what this returns."""
        self._died = f"the {self.name} stage's process {self._process.pid} is gone ({how})"
        log.error("%s", self._died)
        return StageProcessDied(self._died)


# -- the child ---------------------------------------------------------------------------------
def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def serve(conn: Connection, name: str = "stage") -> None:
    """Build the stage, then run each message in order until `close` or the parent is gone. A
    call that fails, that cannot be read or whose answer cannot be sent back is answered with
    its error; a stop that fails is logged: the process goes on for the other slots."""
    events: list[tuple] = []
    jobs: dict[int, Any] = {}
    job_ids = itertools.count()
    stage = None

    def answer(ok: bool, value) -> None:
        try:
            payload = pickle.dumps((ok, value, events[:]), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # an answer that cannot cross fails its call, not the process
            log.warning("an answer could not be pickled", exc_info=True)
            error = RuntimeError(f"the {name} stage's answer could not be sent back: {exc}")
            try:
                payload = pickle.dumps((False, error, events[:]))
            except Exception:  # an event was what failed: the call's error crosses without them
                log.warning("dropped %d event(s) of the %s stage: they could not be pickled", len(events), name)
                payload = pickle.dumps((False, error, []))
        conn.send_bytes(payload)
        events.clear()

    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the stub is gone
            break
        try:
            op, *args = pickle.loads(message)
        except Exception as exc:
            # Not a stop (a slot number always reads), so a call whose caller waits: answer it.
            log.warning("a call could not be read", exc_info=True)
            answer(False, RuntimeError(f"the {name} stage's process could not read the call: {exc!r}"))
            continue
        if op == "stop":
            try:
                stage.stop(*args)
            except Exception:  # nobody waits for a stop's answer: log it, keep the other slots
                log.exception("stopping slot %s failed", args)
            continue
        try:
            if op == "build":
                build, options = args
                stage, info = build(**options, emit=lambda *event: events.append(event))
                value = (stage.num_slots, info)
            elif op == "tick":
                cpu = time.thread_time()
                outputs = stage.tick(*args)
                value = (outputs, time.thread_time() - cpu, stage.last_tick_split)
            elif op == "prefill_many":
                value = stage.prefill_many(*args)
            elif op == "begin_prefills":
                value = next(job_ids)
                jobs[value] = stage.begin_prefills(*args)
            elif op == "advance":
                job = jobs[args[0]]
                done = job.advance()
                if done:
                    del jobs[args[0]]
                value = (done, {slot: _portable(exc) for slot, exc in job.failed.items()})
            elif op == "close":
                stage.close()
                answer(True, None)
                break
            else:
                raise ValueError(f"unknown stage call {op!r}")
        except Exception as exc:
            log.warning("%s failed", op, exc_info=True)  # its traceback, which the pipe does not carry
            _free_cuda_cache(exc)
            answer(False, _portable(exc))
            if op == "build":
                break
            continue
        if op == "prefill_many":
            value = {slot: _portable(exc) for slot, exc in value.items()}
        answer(True, value)


def _free_cuda_cache(exc: Exception) -> None:
    """After a tick that ran out of GPU memory, what this process caches, for the retry."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        torch.cuda.empty_cache()


def main() -> None:
    name, fd = sys.argv[1], int(sys.argv[2])
    # A terminal's Ctrl-C reaches the whole process group: the server's graceful shutdown ends
    # this process (`close`, or its pipe's end), after the stub's last tick.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format=f"{name} stage %(levelname)s %(name)s: %(message)s")
    serve(Connection(fd), name)
