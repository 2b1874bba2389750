"""How far behind a stage's answers are, read across the Python stubs of one tritonserver.

With the stages in stubs of their own (model_repository), the talker's admission by the sends
(scheduler.SENDS_BEHIND_LIMIT_S) cannot ask code2wav's engine: it runs in another process. So
each code2wav instance writes its backlog at every heartbeat of its engine (at least once a
second) into a small file in shared memory, named for the server (the stubs' parent process)
and the instance, and the talker reads the largest fresh one when a newcomer asks to start. A
file not written for STALE_S (its stub gone or not loaded yet) counts as no backlog: a dead
stub is the health check's to report. A stub removes its file at unload; one that was killed
leaves it, and the next writer on the host removes the files of servers no longer running. A
container has a /dev/shm of its own unless it shares the host's IPC namespace. In one stub
(serving/one_stub.py) one engine ticks both stages.
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

STALE_S = 3.0
ORPHAN_AGE_S = 60.0
SUFFIX = ".sends-behind"
# The backlog in seconds, and when it was written: CLOCK_MONOTONIC, one clock for the host's processes.
_RECORD = struct.Struct("=dd")


def gauge_folder() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def _prefix(model: str, server_pid: int | None) -> str:
    return f"personaplex-{os.getppid() if server_pid is None else server_pid}-{model}-"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def remove_orphans(folder: Path) -> None:
    """The files of servers no longer running (a stub killed before its unload), unwritten for
    ORPHAN_AGE_S: a server in another process namespace sharing /dev/shm keeps writing its own."""
    for path in folder.glob(f"personaplex-*{SUFFIX}"):
        pid = path.name.split("-")[1]
        try:
            old = time.time() - path.stat().st_mtime > ORPHAN_AGE_S
        except OSError:  # removed meanwhile
            continue
        if old and pid.isdigit() and not _running(int(pid)):
            path.unlink(missing_ok=True)


class SendsBehindWriter:
    """One model instance's backlog, for the other stubs of its server."""

    def __init__(self, model: str, instance: str, server_pid: int | None = None, folder: Path | None = None):
        folder = folder or gauge_folder()
        self.path = folder / f"{_prefix(model, server_pid)}{instance}{SUFFIX}"
        self._failed = False
        self._fd: int | None = None
        try:
            remove_orphans(folder)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as exc:  # serving goes on without it
            self._warn(exc)

    def _warn(self, exc: OSError) -> None:
        if not self._failed:
            self._failed = True
            log.warning("cannot write the send backlog to %s (%s): the talker's admission will not see it",
                        self.path, exc)

    def write(self, behind_s: float) -> None:
        """From the engine's heartbeat, which a failure here must not stop: it is logged once."""
        if self._fd is None:
            return
        try:  # one write of 16 bytes at offset 0: a reader sees the old record or the new one
            os.pwrite(self._fd, _RECORD.pack(behind_s, time.monotonic()), 0)
        except OSError as exc:
            self._warn(exc)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.path.unlink(missing_ok=True)


def sends_behind_reader(model: str, server_pid: int | None = None,
                        folder: Path | None = None) -> Callable[[], float]:
    """A function giving the largest backlog that `model`'s instances wrote in the last STALE_S."""
    pattern = f"{_prefix(model, server_pid)}*{SUFFIX}"
    where = folder or gauge_folder()

    def read() -> float:
        now, worst = time.monotonic(), 0.0
        for path in where.glob(pattern):
            try:
                data = path.read_bytes()
            except OSError:  # its stub closed it meanwhile
                continue
            if len(data) == _RECORD.size:
                behind_s, written = _RECORD.unpack(data)
                if now - written <= STALE_S:
                    worst = max(worst, behind_s)
        return worst

    return read
