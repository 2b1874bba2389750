"""Tests of the personaplex_stream client that need no tritonserver.

Most run against a small in-process fake of Triton's gRPC service (tritonclient's own
service definition, served with grpcio), which answers each frame in order the way the
`ensemble` model does, so that the client's streaming logic is exercised end to end.
"""

import json
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

import personaplex_stream
from personaplex_stream import (
    ConversationResult,
    Persona,
    ServerError,
    ServerUnreachableError,
    StreamTimeoutError,
    build_persona_inputs,
    build_request_inputs,
    latency_percentiles,
    new_sequence_id,
    stream_conversation,
)
from personaplex_stream import cli
from personaplex_triton import contract
from personaplex_triton.audio import read_wav, write_wav

N = contract.FRAME_SAMPLES


# ----------------------------------------------------------------------------- fake Triton


def _bytes_element(raw: bytes) -> bytes:
    """First element of a serialized BYTES tensor (4-byte length prefix, then the data)."""
    (length,) = struct.unpack("<I", raw[:4])
    return raw[4 : 4 + length]


class FakeTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Answers frame i with AUDIO_OUT = -0.5 * AUDIO_IN and TEXT_OUT = "w{i} ".

    decoupled: follow each data response with a flag-only final response (as a decoupled
    model does with enable_empty_final_response); otherwise flag the data response final.
    error_at: answer that frame with an error instead. stall_at: stop answering from that
    frame on (keeping the stream open). delay_s: time taken per frame.
    """

    def __init__(self, decoupled=True, error_at=None, stall_at=None, delay_s=0.0, model_ready=True):
        self.decoupled = decoupled
        self.error_at = error_at
        self.stall_at = stall_at
        self.delay_s = delay_s
        self.model_ready = model_ready
        self.requests = []  # one dict per received request
        self.max_outstanding = 0
        self._lock = threading.Lock()
        self._received = 0
        self._answered = 0

    def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(ready=self.model_ready and request.name == contract.MODEL_NAME)

    def _record(self, req):
        names = [t.name for t in req.inputs]
        contents = dict(zip(names, req.raw_input_contents))
        rec = {
            "t": time.perf_counter(),
            "names": names,
            "datatypes": {t.name: t.datatype for t in req.inputs},
            "shapes": {t.name: list(t.shape) for t in req.inputs},
            "audio": np.frombuffer(contents[contract.AUDIO_IN], dtype="<f4").copy(),
            "sequence_id": req.parameters["sequence_id"].int64_param,
            "start": req.parameters["sequence_start"].bool_param,
            "end": req.parameters["sequence_end"].bool_param,
            "empty_final": req.parameters["triton_enable_empty_final_response"].bool_param,
            "outputs": [o.name for o in req.outputs],
            "model": req.model_name,
        }
        for name in (contract.VOICE, contract.TEXT_PROMPT):
            if name in contents:
                rec[name] = _bytes_element(contents[name]).decode()
        for name, dt in ((contract.SEED, "<i8"), (contract.TOP_K, "<i4"), (contract.TOP_K_TEXT, "<i4"),
                         (contract.TEMPERATURE, "<f4"), (contract.TEMPERATURE_TEXT, "<f4"), (contract.GREEDY, "?")):
            if name in contents:
                rec[name] = np.frombuffer(contents[name], dtype=dt)[0].item()
        with self._lock:
            self.requests.append(rec)
            self._received += 1
            self.max_outstanding = max(self.max_outstanding, self._received - self._answered)
        return rec

    def _response(self, i, rec, final):
        r = service_pb2.ModelInferResponse(model_name=rec["model"])
        audio = r.outputs.add()
        audio.name, audio.datatype = contract.AUDIO_OUT, "FP32"
        audio.shape.extend([N])
        text = r.outputs.add()
        text.name, text.datatype = contract.TEXT_OUT, "BYTES"
        text.shape.extend([1])
        r.raw_output_contents.append((-0.5 * rec["audio"]).astype("<f4").tobytes())
        piece = f"w{i} ".encode()
        r.raw_output_contents.append(struct.pack("<I", len(piece)) + piece)
        if final:
            r.parameters["triton_final_response"].bool_param = True
        return service_pb2.ModelStreamInferResponse(infer_response=r)

    def ModelStreamInfer(self, request_iterator, context):
        pending = []
        cond = threading.Condition()
        done = []

        def reader():
            try:
                for req in request_iterator:
                    rec = self._record(req)
                    with cond:
                        pending.append(rec)
                        cond.notify()
            except Exception:
                pass
            with cond:
                done.append(True)
                cond.notify()

        threading.Thread(target=reader, daemon=True).start()
        i = 0
        while True:
            with cond:
                while not pending and not done:
                    cond.wait(0.05)
                    if not context.is_active():
                        return
                if not pending:
                    return
                rec = pending.pop(0)
            if self.stall_at is not None and i >= self.stall_at:
                while context.is_active():
                    time.sleep(0.02)
                return
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.error_at is not None and i == self.error_at:
                yield service_pb2.ModelStreamInferResponse(error_message=f"boom: frame {i} rejected")
                i += 1
                continue
            with self._lock:
                self._answered += 1
            yield self._response(i, rec, final=not self.decoupled)
            if self.decoupled:
                empty = service_pb2.ModelInferResponse(model_name=rec["model"])
                empty.parameters["triton_final_response"].bool_param = True
                yield service_pb2.ModelStreamInferResponse(infer_response=empty)
            i += 1


@pytest.fixture
def fake_triton():
    servers = []

    def start(**kwargs):
        fake = FakeTriton(**kwargs)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return fake, f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0)


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


def test_client_does_not_import_torch():
    code = "import sys, personaplex_stream, personaplex_stream.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


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
    json.dumps(s)  # JSON-ready
    empty = ConversationResult(np.zeros(0, np.float32), [], 1, 0, 0, None)
    assert empty.summary()["latency_ms_p50"] is None


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


# ----------------------------------------------------------------------------- against the fake


@pytest.mark.parametrize("decoupled", [True, False])
def test_conversation_round_trip(fake_triton, decoupled):
    fake, url = fake_triton(decoupled=decoupled)
    pcm = _speechlike(7 * N + 333)  # 8 frames, the last one padded
    progress = []
    persona = Persona(voice="NATF0", text_prompt="You are a helpful agent.", seed=42, temperature=0.8, top_k=250)
    res = stream_conversation(pcm, url=url, persona=persona, sequence_id=1234,
                              on_progress=lambda k, n: progress.append((k, n)))
    assert res.frames_sent == res.frames_received == 8
    assert res.audio.dtype == np.float32 and res.audio.size == 8 * N
    padded = np.zeros(8 * N, np.float32)
    padded[: pcm.size] = pcm
    np.testing.assert_allclose(res.audio, -0.5 * padded, atol=1e-7)  # in order, frame for frame
    assert res.text_pieces == [f"w{i} " for i in range(8)] and res.text == "".join(f"w{i} " for i in range(8))
    assert progress[-1] == (8, 8) and [k for k, _ in progress] == list(range(1, 9))
    assert len(res.latencies_ms) == 8 and all(x >= 0 for x in res.latencies_ms)
    assert res.first_audio_ms == res.latencies_ms[0]
    assert res.latency_ms_p50 <= res.latency_ms_p95

    reqs = fake.requests
    assert len(reqs) == 8
    assert all(r["sequence_id"] == 1234 and r["empty_final"] and r["model"] == "ensemble" for r in reqs)
    assert [r["start"] for r in reqs] == [True] + [False] * 7
    assert [r["end"] for r in reqs] == [False] * 7 + [True]
    assert all(r["shapes"][contract.AUDIO_IN] == [N] and r["datatypes"][contract.AUDIO_IN] == "FP32" for r in reqs)
    assert sorted(reqs[0]["outputs"]) == sorted([contract.AUDIO_OUT, contract.TEXT_OUT])
    first = reqs[0]
    assert first["names"] == [contract.AUDIO_IN, contract.VOICE, contract.TEXT_PROMPT, contract.SEED,
                              contract.TEMPERATURE, contract.TOP_K]
    assert (first[contract.VOICE], first[contract.TEXT_PROMPT], first[contract.SEED]) == \
        ("NATF0", "You are a helpful agent.", 42)
    assert first[contract.TEMPERATURE] == pytest.approx(0.8) and first[contract.TOP_K] == 250
    assert all(r["names"] == [contract.AUDIO_IN] for r in reqs[1:])  # persona on the first request only


def test_random_sequence_id(fake_triton):
    fake, url = fake_triton()
    res = stream_conversation(_speechlike(2 * N), url=url)
    sid = fake.requests[0]["sequence_id"]
    assert 0 < sid < 2**63 and res.sequence_id == sid


def test_in_flight_is_bounded(fake_triton):
    fake, url = fake_triton(delay_s=0.01)
    res = stream_conversation(_speechlike(40 * N), url=url, max_in_flight=8)
    assert res.frames_received == 40
    assert 2 <= fake.max_outstanding <= 8
    fake1, url1 = fake_triton()
    stream_conversation(_speechlike(10 * N), url=url1, max_in_flight=1)
    assert fake1.max_outstanding == 1


def test_server_error_surfaces_with_message(fake_triton):
    _, url = fake_triton(error_at=3)
    with pytest.raises(ServerError, match="boom: frame 3 rejected"):
        stream_conversation(_speechlike(10 * N), url=url)


def test_model_not_ready(fake_triton):
    _, url = fake_triton()
    with pytest.raises(ServerError, match="not ready"):
        stream_conversation(_speechlike(N), url=url, model_name="nope")


@pytest.mark.parametrize("realtime", [False, True])
def test_stalled_server_times_out(fake_triton, realtime):
    _, url = fake_triton(stall_at=2)
    t0 = time.monotonic()
    with pytest.raises(StreamTimeoutError, match="no response"):
        stream_conversation(_speechlike(6 * N), url=url, response_timeout_s=0.5, realtime=realtime)
    assert time.monotonic() - t0 < 8


def test_realtime_pacing(fake_triton):
    fake, url = fake_triton()
    n = 12
    t0 = time.perf_counter()
    res = stream_conversation(_speechlike(n * N), url=url, realtime=True)
    elapsed = time.perf_counter() - t0
    assert res.frames_received == n
    arrivals = np.array([r["t"] for r in fake.requests])
    span = arrivals[-1] - arrivals[0]
    assert span == pytest.approx((n - 1) * 0.08, abs=0.05)  # absolute schedule: no drift
    offsets = arrivals - arrivals[0] - np.arange(n) * 0.08
    assert np.max(np.abs(offsets)) < 0.05
    assert elapsed >= (n - 1) * 0.08
    # responses come right away: latency is far below a frame
    assert res.latency_ms_p50 < 80


def test_cli_end_to_end_json(fake_triton, tmp_path, capsys):
    _, url = fake_triton()
    inp = tmp_path / "in.wav"
    rate = 44100
    stereo = np.stack([_speechlike(rate), _speechlike(rate, seed=1)], axis=1)  # 1 s, 44.1 kHz stereo
    from scipy.io import wavfile

    wavfile.write(inp, rate, np.round(stereo * 32767).astype(np.int16))
    out = tmp_path / "agent.wav"
    rc = cli.main(["--input", str(inp), "--output", str(out), "--url", url, "--voice", "NATM0", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    n_frames = int(np.ceil(24000 / N))  # 1 s at 24 kHz -> 13 frames
    assert summary["frames_sent"] == summary["frames_received"] == n_frames
    for key in ("first_audio_ms", "latency_ms_p50", "latency_ms_p95", "text", "output", "text_output"):
        assert key in summary
    assert summary["output"] == str(out) and summary["text_output"] == str(out.with_suffix(".txt"))
    assert "frames received" in captured.err  # progress on stderr
    agent = read_wav(out)
    assert agent.size == n_frames * N
    expected_text = "".join(f"w{i} " for i in range(n_frames))
    assert summary["text"] == expected_text
    assert out.with_suffix(".txt").read_text().strip() == expected_text.strip()


def test_cli_text_output_and_plain_report(fake_triton, tmp_path, capsys):
    _, url = fake_triton()
    inp = tmp_path / "in.wav"
    write_wav(inp, _speechlike(2 * N))
    txt = tmp_path / "words.txt"
    rc = cli.main(["--input", str(inp), "--output", str(tmp_path / "o.wav"), "--url", url,
                   "--text-output", str(txt), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert txt.read_text() == "w0 w1 \n"
    assert str(txt) in out and "p50" in out and "p95" in out
