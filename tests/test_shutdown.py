"""The launcher's and the talker's shutdown bookkeeping (shutdown.py); the whole shutdown runs
against a real server in tests/test_faults.py."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from personaplex_triton.serving import shutdown
from personaplex_triton.serving.shutdown import OpenSequences


def test_open_sequences_follow_start_and_end_and_forget_the_reaped():
    sequences = OpenSequences(forget_after_s=120)
    sequences.note(1, end=False, now=0)
    sequences.note(2, end=False, now=10)
    sequences.note(3, end=False, now=20)
    sequences.note(2, end=True, now=30)      # ended by its client
    sequences.note(1, end=False, now=100)    # still talking: not forgotten at 130
    sequences.note(4, end=False, now=130)    # 3 was idle 110 s: still kept
    assert sorted(sequences.take()) == [1, 3, 4]
    assert sequences.take() == []            # taken: ending them is the caller's
    sequences.note(5, end=False, now=200)
    sequences.note(6, end=False, now=330)    # 5 idle 130 s: Triton's reaper has ended it
    assert sequences.take() == [6]


def test_the_launcher_waits_for_live_drainers_and_reports_who_did_not_finalize(tmp_path, monkeypatch):
    monkeypatch.setenv(shutdown.SHUTDOWN_DIR_ENV, str(tmp_path))
    shutdown.register("talker_0_0", drains=True)     # this process: alive
    shutdown.register("code2wav_0_0", drains=False)
    assert not shutdown.drained(tmp_path)
    (tmp_path / ("talker_0_0" + shutdown.DRAINED_SUFFIX)).touch()
    assert shutdown.drained(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / ("talker_1_0" + shutdown.SERVING_SUFFIX)).write_text(f"{dead.pid} drains")
    assert shutdown.drained(tmp_path)                 # a dead stub is not waited for
    shutdown.mark_finalized("code2wav_0_0")
    assert shutdown.not_finalized(tmp_path) == ["talker_0_0", "talker_1_0"]


def test_a_zombie_stub_is_not_waited_for(tmp_path, monkeypatch):
    """A killed stub that tritonserver has not reaped yet is a zombie: dead, though its pid answers."""
    monkeypatch.setenv(shutdown.SHUTDOWN_DIR_ENV, str(tmp_path))
    zombie = subprocess.Popen(["true"])  # not waited for: a zombie once it exits
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (tmp_path / ("talker_0_0" + shutdown.SERVING_SUFFIX)).write_text(f"{zombie.pid} drains")
        assert shutdown.drained(tmp_path)
    finally:
        zombie.wait()


def _alive_not_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_stub_that_outlives_tritonserver_is_killed(tmp_path):
    """A stand-in for tritonserver leaves a child that ignores SIGTERM (as a hung stub does)
    and exits on SIGTERM itself: the launcher's SIGTERM ends both, and the launcher exits 0."""
    pid_file = tmp_path / "stub.pid"
    server = tmp_path / "server.py"
    server.write_text(textwrap.dedent(f"""
        import signal, subprocess, sys, time
        stub = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
        open({str(pid_file)!r}, "w").write(str(stub.pid))
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        time.sleep(300)
    """))
    launcher = subprocess.Popen([sys.executable, "-c", "import sys; from personaplex_triton.serving.launch import serve; "
                                 f"sys.exit(serve([sys.executable, {str(server)!r}], {{}}, 1))"])
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the stand-in server never started its stub"
            time.sleep(0.05)
        stub = int(pid_file.read_text())
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 0
        deadline = time.monotonic() + 5
        while _alive_not_zombie(stub) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive_not_zombie(stub), "the stub outlived the launcher"
    finally:
        launcher.kill()
        if pid_file.exists() and pid_file.read_text() and _alive_not_zombie(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_servers_ports_are_distinct():
    """The launcher's HTTP, gRPC and metrics ports are bound together before any is handed out:
    bound and closed one by one, the system may hand out one port twice (a test server's HTTP
    and metrics ports once did, and tritonserver would not start)."""
    from personaplex_triton.serving.launch import free_ports

    for _ in range(20):
        ports = free_ports(50)
        assert len(set(ports)) == 50 and all(port > 0 for port in ports)
