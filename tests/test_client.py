"""Tests of the personaplex_stream client that need no server: arguments, framing, figures,
and clear failures. Streaming itself is tested against a real tritonserver in
test_integration.py."""

import io
import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import personaplex_stream
from personaplex_stream import (
    AnsweredFrame,
    ConversationResult,
    LiveLine,
    Persona,
    ServerUnreachableError,
    build_persona_inputs,
    build_request_inputs,
    latency_percentiles,
    new_sequence_id,
    stream_conversation,
)
from personaplex_stream import cli
from personaplex_stream import contract
from personaplex_stream.audio import write_wav

N = contract.FRAME_SAMPLES


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _speechlike(n_samples, seed=0):
    rng = np.random.default_rng(seed)
    return (0.3 * rng.uniform(-1, 1, n_samples)).astype(np.float32)


# ----------------------------------------------------------------------------- pure helpers


def test_public_api_exports():
    for name in ("stream_conversation", "Persona", "ConversationResult", "StreamError", "ServerError",
                 "ServerUnreachableError", "StreamTimeoutError"):
        assert hasattr(personaplex_stream, name)


def test_client_does_not_import_torch_or_scipy():
    code = ("import sys, personaplex_stream, personaplex_stream.cli; "
            "print([m for m in ('torch', 'scipy', 'personaplex_triton') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_parse_args_defaults():
    args = cli.build_parser().parse_args(["--input", "a.wav", "--output", "b.wav"])
    assert args.url == "localhost:8001" and args.model == "ensemble"
    assert not args.realtime and not args.json
    persona = cli.persona_from_args(args)
    assert persona == Persona()  # nothing given: nothing sent
    assert build_persona_inputs(persona) == []
    assert str(cli.text_output_path(args)) == "b.txt"


def test_parse_args_all_options():
    args = cli.build_parser().parse_args([
        "--input", "a.wav", "--output", "out/b.wav", "--url", "h:9001", "--model", "m",
        "--voice", "NATM0", "--prompt", "You are kind.", "--seed", "7", "--greedy",
        "--temperature", "0.7", "--temperature-text", "0.6", "--top-k", "250", "--top-k-text", "25",
        "--realtime", "--json", "--text-output", "t.txt",
    ])
    assert (args.url, args.model, args.realtime, args.json) == ("h:9001", "m", True, True)
    assert cli.persona_from_args(args) == Persona("NATM0", "You are kind.", 7, True, 0.7, 0.6, 250, 25)
    assert str(cli.text_output_path(args)) == "t.txt"


def test_persona_inputs_only_the_given_ones():
    inputs = build_persona_inputs(Persona(voice="NATF0", seed=3, greedy=False, top_k_text=5))
    got = {t.name(): (t.datatype(), t.shape()) for t in inputs}
    assert got == {
        contract.VOICE: ("BYTES", [1]),
        contract.SEED: ("INT64", [1]),
        contract.GREEDY: ("BOOL", [1]),
        contract.TOP_K_TEXT: ("INT32", [1]),
    }
    full = build_persona_inputs(Persona("v", "p", 1, True, 0.5, 0.5, 1, 1))
    assert [t.name() for t in full] == list(contract.PERSONA_INPUTS)
    assert {t.name(): t.datatype() for t in full}[contract.TEMPERATURE] == "FP32"


def test_request_inputs_framing():
    frame = np.ones(N, dtype=np.float64)
    first = build_request_inputs(frame, Persona(voice="NATF0"), first=True)
    later = build_request_inputs(frame, Persona(voice="NATF0"), first=False)
    assert [t.name() for t in first] == [contract.AUDIO_IN, contract.VOICE]
    assert [t.name() for t in later] == [contract.AUDIO_IN]
    assert (later[0].datatype(), later[0].shape()) == ("FP32", [N])
    with pytest.raises(ValueError):
        build_request_inputs(np.ones(N + 1))


def test_new_sequence_id():
    ids = {new_sequence_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(0 < i < 2**63 for i in ids)


def test_latency_percentiles_and_summary():
    lat = [float(x) for x in range(10, 110, 10)]  # 10 .. 100
    assert latency_percentiles(lat) == pytest.approx((55.0, 95.5))
    assert latency_percentiles([]) == (None, None)
    res = ConversationResult(
        audio=np.zeros(10 * N, np.float32), text_pieces=["Hel", "lo", "", " there"], sequence_id=5,
        frames_sent=10, frames_received=10, first_audio_ms=10.0, latencies_ms=lat, wall_s=0.9,
    )
    assert res.text == "Hello there"
    assert res.latency_ms_p50 == pytest.approx(55.0) and res.latency_ms_p95 == pytest.approx(95.5)
    s = res.summary()
    assert s["frames_sent"] == 10 and s["frames_received"] == 10 and s["sequence_id"] == 5
    assert s["first_audio_ms"] == 10.0 and s["latency_ms_p50"] == 55.0 and s["latency_ms_p95"] == 95.5
    assert s["audio_seconds"] == pytest.approx(0.8) and s["text"] == "Hello there"
    assert s["real_time_factor"] == pytest.approx(0.9 / 0.8)  # 0.9 s to answer 0.8 s of speech
    json.dumps(s)  # JSON-ready
    empty = ConversationResult(np.zeros(0, np.float32), [], 1, 0, 0, None)
    assert empty.summary()["latency_ms_p50"] is None and empty.summary()["real_time_factor"] is None


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _frames(pieces):
    return [AnsweredFrame(i, len(pieces), 100.0 + i, piece) for i, piece in enumerate(pieces)]


def test_live_line_on_a_terminal_is_one_line_rewritten_to_its_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "50")
    out = _Terminal()
    live = LiveLine(out)
    frames = _frames(["Hello", " there,", " how", " can", " I", " help", " you", " today", "?"])
    for frame in frames:
        live(frame)
        time.sleep(0.11)  # past the 10-a-second bound: each frame is shown
    live.end()
    shown = out.getvalue()
    assert shown.endswith("\n") and shown.count("\n") == 1
    updates = shown.rstrip("\n").split("\r")[1:]
    assert len(updates) == len(frames)
    assert all(len(update) == 49 for update in updates)  # the width less one: no wrapping
    assert updates[0].startswith("frame 1/9  latency 100 ms  text: Hello")
    assert updates[-1].startswith("frame 9/9  latency 108 ms  text: ...") and updates[-1].rstrip().endswith("today?")


def test_live_line_elsewhere_is_a_plain_line_now_and_then():
    out = io.StringIO()
    live = LiveLine(out, every_s=60)
    for frame in _frames(["Hi", "", " there"]):
        live(frame)
    live.end()
    assert "\r" not in out.getvalue()
    assert out.getvalue().splitlines() == ["frame 1/3  latency 100 ms  text: Hi",
                                           "frame 3/3  latency 102 ms  text: Hi there"]  # the first and the last


def test_empty_audio_is_rejected():
    with pytest.raises(ValueError):
        stream_conversation(np.zeros(0, np.float32), url=f"127.0.0.1:{_closed_port()}")


# ----------------------------------------------------------------------------- unreachable server


@pytest.mark.parametrize("check_ready", [True, False])
def test_unreachable_url_raises_quickly(check_ready):
    url = f"127.0.0.1:{_closed_port()}"
    t0 = time.monotonic()
    with pytest.raises(ServerUnreachableError, match=url.replace(".", r"\.")):
        stream_conversation(_speechlike(5 * N), url=url, check_ready=check_ready, response_timeout_s=30)
    assert time.monotonic() - t0 < 10


def test_cli_unreachable_server(tmp_path, capsys):
    inp = tmp_path / "in.wav"
    write_wav(inp, _speechlike(3 * N))
    rc = cli.main(["--input", str(inp), "--output", str(tmp_path / "o.wav"),
                   "--url", f"127.0.0.1:{_closed_port()}", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert len(err.splitlines()) == 1 and err.startswith("personaplex-stream: error:") and "reach" in err
    assert not (tmp_path / "o.wav").exists()


def test_cli_unreadable_input(tmp_path, capsys):
    bad = tmp_path / "bad.wav"
    bad.write_text("not audio")
    rc = cli.main(["--input", str(bad), "--output", str(tmp_path / "o.wav")])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1 and "bad.wav" in err
    rc = cli.main(["--input", str(tmp_path / "missing.wav"), "--output", str(tmp_path / "o.wav")])
    assert rc != 0 and "missing.wav" in capsys.readouterr().err


def test_cli_missing_output_dir(tmp_path, capsys):
    inp = tmp_path / "in.wav"
    write_wav(inp, _speechlike(N))
    rc = cli.main(["--input", str(inp), "--output", str(tmp_path / "nodir" / "o.wav")])
    assert rc != 0 and "nodir" in capsys.readouterr().err
