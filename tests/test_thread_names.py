"""The project's threads named for the OS (core/thread_names.py), and read back by thread (bench/host_cpu.py)."""

import threading
import time
from pathlib import Path

import pytest

from bench import host_cpu
from personaplex_triton.core.thread_names import COMM_BYTES, name_os_threads
from polling import wait_for

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="no /proc on this system")


def test_a_python_thread_gets_its_name_in_the_os_and_its_cpu_is_read_by_it():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin, name="personaplex-spinner-with-a-long-name")
    thread.start()
    try:
        comm = Path(f"/proc/self/task/{thread.native_id}/comm")
        assert comm.read_text().strip() != "personaplex-spi"
        name_os_threads()
        assert comm.read_text().strip() == "personaplex-spinner-with-a-long-name"[:COMM_BYTES]
        main = Path(f"/proc/self/task/{threading.main_thread().native_id}/comm").read_text().strip()
        assert main == Path("/proc/self/comm").read_text().strip()  # the process keeps its name
        import os
        before = host_cpu.thread_snapshot(os.getpid())
        time.sleep(0.3)
        spent = host_cpu.cpu_by_role(before, host_cpu.thread_snapshot(os.getpid()))
    finally:
        stop.set()
        thread.join()
    [spinner] = [name for name in spent if name.endswith(": personaplex-spi")]
    assert spent[spinner] > 0.05  # it spun most of the 0.3 s (sharing the GIL with nobody busy)
    assert any(name.endswith(": main") for name in spent)


def test_a_thread_started_outside_python_keeps_its_own_name():
    """As Triton's stub's threads that call into Python: `threading` calls them "Dummy-N"."""
    import _thread

    seen, stop = [], threading.Event()

    def foreign():
        seen.append(threading.current_thread())  # makes its _DummyThread
        stop.wait(5)

    _thread.start_new_thread(foreign, ())
    try:
        assert wait_for(lambda: seen, every_s=0.01)
        comm = Path(f"/proc/self/task/{seen[0].native_id}/comm")
        before = comm.read_text()
        assert seen[0].name.startswith("Dummy-")
        name_os_threads()
        assert comm.read_text() == before
    finally:
        stop.set()
