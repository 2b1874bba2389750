"""A stage's send backlog read across processes (serving/sends_gauge.py): what code2wav's stub
writes at each heartbeat, the talker's stub reads for its admission."""

import os
import subprocess
import sys
import time

from personaplex_triton.serving import sends_gauge
from personaplex_triton.serving.sends_gauge import SendsBehindWriter, sends_behind_reader

SERVER = os.getpid()  # the files are named for their server: here, this process, which runs


def test_the_largest_fresh_backlog_of_a_models_instances_is_read_in_another_process(tmp_path):
    first = SendsBehindWriter("code2wav", "code2wav_0_0", SERVER, tmp_path)
    second = SendsBehindWriter("code2wav", "code2wav_1_0", SERVER, tmp_path)
    other_server = SendsBehindWriter("code2wav", "code2wav_0_0", os.getppid(), tmp_path)
    other_model = SendsBehindWriter("talker", "talker_0_0", SERVER, tmp_path)
    first.write(0.4)
    second.write(1.5)
    other_server.write(9.0)
    other_model.write(8.0)
    program = ("import sys; from pathlib import Path; from personaplex_triton.serving.sends_gauge import "
               f"sends_behind_reader as r; print(r('code2wav', {SERVER}, Path(sys.argv[1]))())")
    read_there = subprocess.run([sys.executable, "-c", program, str(tmp_path)], capture_output=True, text=True,
                                check=True)
    assert float(read_there.stdout) == 1.5
    second.write(0.0)  # caught up
    assert sends_behind_reader("code2wav", SERVER, tmp_path)() == 0.4
    for writer in (first, second, other_server, other_model):
        writer.close()
    assert list(tmp_path.iterdir()) == []  # a closed writer leaves nothing behind


def test_a_backlog_not_written_for_a_while_counts_as_none(tmp_path, monkeypatch):
    read = sends_behind_reader("code2wav", SERVER, tmp_path)
    assert read() == 0.0  # no instance has written yet
    writer = SendsBehindWriter("code2wav", "code2wav_0_0", SERVER, tmp_path)
    assert read() == 0.0  # opened, nothing written: not a record
    writer.write(2.0)
    assert read() == 2.0
    monkeypatch.setattr(sends_gauge, "STALE_S", 0.05)
    time.sleep(0.1)
    assert read() == 0.0  # its stub stopped writing: gone or hung, the health check's to say
    writer.close()


def test_a_killed_servers_file_is_removed_by_the_next_writer_once_unwritten_for_a_minute(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a process id no process has now
    orphan = tmp_path / f"personaplex-{gone.pid}-code2wav-code2wav_0_0{sends_gauge.SUFFIX}"
    orphan.write_bytes(bytes(16))
    # another namespace's server, whose process id is not one here, writes its file still
    elsewhere = tmp_path / f"personaplex-{gone.pid}-code2wav-code2wav_1_0{sends_gauge.SUFFIX}"
    elsewhere.write_bytes(bytes(16))
    an_hour_ago = time.time() - 3600
    os.utime(orphan, (an_hour_ago, an_hour_ago))
    living = SendsBehindWriter("code2wav", "code2wav_0_0", os.getppid(), tmp_path)
    os.utime(living.path, (an_hour_ago, an_hour_ago))  # its server runs: kept however old
    writer = SendsBehindWriter("code2wav", "code2wav_0_0", SERVER, tmp_path)
    assert sorted(tmp_path.iterdir()) == sorted([elsewhere, living.path, writer.path])
    living.close()
    writer.close()


def test_a_gauge_that_cannot_be_written_is_logged_once_and_raises_nothing(tmp_path, caplog):
    writer = SendsBehindWriter("code2wav", "code2wav_0_0", SERVER, tmp_path / "no such folder")
    writer.write(0.1)
    writer.write(0.2)
    writer.close()
    assert [r.message.startswith("cannot write the send backlog") for r in caplog.records] == [True]
    writer = SendsBehindWriter("code2wav", "code2wav_0_0", SERVER, tmp_path)
    os.close(writer._fd)  # every write fails now, as on a full /dev/shm
    writer.write(0.1)
    writer.write(0.2)
    assert len(caplog.records) == 2 and "Bad file descriptor" in caplog.records[1].message
