"""The client installed on its own (`pip install ./client`) into a clean venv: it needs no
torch, scipy or server package, and streams a conversation through a real tritonserver."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from personaplex_stream import Persona, stream_conversation
from personaplex_stream.audio import read_wav, write_wav

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVER_ONLY = ("torch", "scipy", "onnxruntime", "personaplex_triton")


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("client-install")
    source, venv = root / "client", root / "venv"
    # pip builds in the source folder (build/, *.egg-info): a copy keeps the checkout clean.
    shutil.copytree(REPO_ROOT / "client", source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    # A venv without pip of its own (copying pip in takes seconds): this venv's pip installs into it.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                              str(source)], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr
    return venv


def test_client_venv_has_no_server_packages(client_venv):
    code = ("import importlib.util, sys; "
            f"print([m for m in {SERVER_ONLY!r} if importlib.util.find_spec(m) is not None])")
    found = subprocess.run([str(client_venv / "bin" / "python"), "-c", code],
                           capture_output=True, text=True, check=True).stdout
    assert found.strip() == "[]"


def test_client_venv_streams_a_conversation(client_venv, server, tmp_path):
    """The installed `personaplex-stream`, paced like a microphone, with 16 kHz input (resampled
    by the client): the same answer as this venv's client gives for the same persona and seed."""
    speech = read_wav(REPO_ROOT / "samples" / "user.wav", sample_rate=16000)[:16000]  # 1 s
    write_wav(tmp_path / "user.wav", speech, 16000)
    out = tmp_path / "agent.wav"
    run = subprocess.run([str(client_venv / "bin" / "personaplex-stream"), "--input", str(tmp_path / "user.wav"),
                          "--output", str(out), "--url", server.grpc_url, "--voice", "NATM0", "--seed", "11",
                          "--realtime", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["frames_sent"] == summary["frames_received"] == 13  # 1 s: 12.5 frames, the last padded

    again = stream_conversation(read_wav(tmp_path / "user.wav"), url=server.grpc_url,
                                persona=Persona(voice="NATM0", seed=11))
    assert summary["text"] == again.text
    agent = read_wav(out)
    assert agent.size == 13 * 1920 and np.abs(agent).max() > 0
    assert np.max(np.abs(agent - again.audio)) < 2e-4  # the WAV holds 16-bit samples
