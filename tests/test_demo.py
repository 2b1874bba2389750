"""`make demo` (scripts/demo.py) end to end: its own tritonserver, 2 s of the sample paced like
a microphone, progress as plain lines when stdout is not a terminal, and its figures."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from personaplex_stream.audio import read_wav, write_wav

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[1]
FRAMES = 25  # 2 s


def test_demo_streams_in_real_time_from_a_persona_prefilled_at_load(tiny_checkpoint, tmp_path):
    speech = tmp_path / "user.wav"
    write_wav(speech, read_wav(REPO_ROOT / "samples" / "user.wav")[:FRAMES * 1920])
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "demo.py"), "--input", str(speech),
                          "--out", str(out)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PERSONAPLEX_CHECKPOINT": str(tiny_checkpoint)})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "personas prefilled at load: NATF0, NATM0" in run.stdout
    assert "its persona's prefill comes first" not in run.stdout  # voice NATF0, no role prompt: prefilled

    assert "\r" not in run.stdout  # stdout is a pipe: plain lines, not one rewritten line
    progress = [line for line in run.stdout.splitlines() if re.match(r"frame \d+/\d+  ", line)]
    assert progress[0].startswith(f"frame 1/{FRAMES}  latency ") and progress[-1].startswith(f"frame {FRAMES}/{FRAMES}  ")

    summary = json.loads((out / "summary.json").read_text())
    assert summary["frames_sent"] == summary["frames_received"] == FRAMES
    assert summary["persona_prefilled_at_load"] and summary["prefilled_at_load"] == ["NATF0", "NATM0"]
    # Paced: the last frame leaves 24 frame durations after the first, so the whole answer
    # cannot take less than that (an unpaced client on a fast server would).
    assert summary["real_time_factor"] >= (FRAMES - 1) / FRAMES
    for figure in ("real-time factor", "first audio", "p50", "p95"):
        assert figure in run.stdout
    assert read_wav(out / "agent.wav").size == FRAMES * 1920
