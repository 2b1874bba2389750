"""The project's threads named where the OS shows them, so that a host's CPU can be read thread by
thread from /proc (bench/host_cpu.py), `top -H` or a native profiler, without attaching to Python.

Python's thread names are its own; on Linux, writing /proc/self/task/TID/comm names a thread for
the OS (15 bytes at most). The engine's heartbeat calls `name_os_threads`, which names the
threads started since its last call: the outbox's lanes, the metrics reporter, a Mimi encoder's
worker, the engine's own loop.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path

COMM_BYTES = 15  # the kernel keeps a thread's name to this many bytes

_named: weakref.WeakSet = weakref.WeakSet()


def name_os_threads() -> None:
    """Give each live Python thread of this process but the main one its Python name in the OS,
    once. The main thread keeps the process's name (what `ps` shows), and so do threads started
    outside Python (Triton's stub calls `execute` from its own): Python knows them as "Dummy-N",
    which says less than the name they have. Elsewhere than Linux, or where the kernel refuses,
    nothing happens."""
    for thread in threading.enumerate():
        if thread in _named or thread is threading.main_thread() or thread.native_id is None \
                or isinstance(thread, threading._DummyThread):
            continue
        _named.add(thread)
        try:
            Path(f"/proc/self/task/{thread.native_id}/comm").write_bytes(thread.name.encode()[:COMM_BYTES])
        except OSError:
            pass
