"""`make web` (scripts/web.py) end to end: its own tritonserver and gateway, the URL it prints
serving the page with Triton ready behind it, and Ctrl-C stopping everything it started."""

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from personaplex_triton.serving.launch import SHUTDOWN_BOUND_S, child_processes, free_port

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 600  # a loaded 2-core machine: tritonserver's model load, then the gateway


def descendants(pid: int) -> dict[int, list[str]]:
    found = {}
    for child, argv in child_processes(pid).items():
        found[child] = argv
        found.update(descendants(child))
    return found


def running(pid: int) -> bool:
    """Alive, not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def read_until_url(process: subprocess.Popen, timeout_s: float) -> tuple[str, list[str]]:
    """The URL of the "Open URL" line, and the lines before it."""
    lines = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"web.py ended before it printed the URL: {lines}")
        lines.append(line.rstrip("\n"))
        if line.startswith("Open "):
            return line.split()[1], lines
    raise AssertionError(f"no URL within {timeout_s} s: {lines}")


def test_web_serves_the_page_and_ctrl_c_stops_both(tiny_checkpoint, tmp_path):
    port = free_port()
    process = subprocess.Popen([sys.executable, str(REPO_ROOT / "scripts" / "web.py"), f"--port={port}",
                                f"--out={tmp_path}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PERSONAPLEX_CHECKPOINT": str(tiny_checkpoint)})
    try:
        url, lines = read_until_url(process, START_TIMEOUT_S)
        assert url == f"http://localhost:{port}/"
        assert any(line.startswith("tritonserver ready in ") for line in lines)
        with urllib.request.urlopen(url, timeout=10) as reply:
            assert reply.status == 200 and "<title>PersonaPlex</title>" in reply.read().decode()
        with urllib.request.urlopen(url + "healthz", timeout=10) as reply:
            assert reply.status == 200  # Triton ready behind the gateway when the URL is printed
        started = descendants(process.pid)
        assert any("personaplex_gateway" in argv for argv in started.values())
        assert any(argv[0].endswith("tritonserver") for argv in started.values())
    finally:
        process.send_signal(signal.SIGINT)  # Ctrl-C
        rest = process.communicate(timeout=SHUTDOWN_BOUND_S + 30)[0]
    assert process.returncode == 0 and "stopped" in rest
    left = [pid for pid in started if running(pid)]
    assert not left, f"still running after Ctrl-C: {[started[pid] for pid in left]}"
    assert (tmp_path / "tritonserver.log").stat().st_size > 0 and (tmp_path / "gateway.log").stat().st_size > 0
