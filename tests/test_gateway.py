"""The WebSocket gateway against a real tritonserver (the session's `server`), with real
WebSocket clients (aiohttp's) on both protocols: audio in and out, frame counts, text, and
each refusal. The gateways run as their console command does, one process each."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import sphn

from personaplex_stream import contract
from personaplex_gateway.readiness import wait_answering
from personaplex_gateway.voices import voices_in_checkpoint
from personaplex_stream.audio import read_wav
from personaplex_triton.core.metrics import scrape
from personaplex_triton.serving.launch import free_port

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[1]

FRAME = contract.FRAME_SAMPLES
FRAME_S = FRAME / contract.SAMPLE_RATE
SECONDS = 2.0  # each conversation's user audio
CHUNK = 4800  # 0.2 s a message: 2.5 frames, so the gateway must re-frame


@contextmanager
def gateway_process(triton_url: str, *flags: str, scheme: str = "http", trust: ssl.SSLContext | None = None,
                    log_path: Path | None = None):
    """`python -m personaplex_gateway` on a free port until the block ends; yields its base URL.
    `flags` name its voices: the served checkpoint (`checkpoint_flag`) or --voices. Its output
    goes to `log_path` where given."""
    port = free_port()
    output = open(log_path, "wb") if log_path else subprocess.PIPE
    process = subprocess.Popen([sys.executable, "-m", "personaplex_gateway", "--triton-url", triton_url,
                                "--port", str(port), *flags],
                               stdout=output, stderr=subprocess.STDOUT)
    url = f"{scheme}://127.0.0.1:{port}"
    try:
        try:
            wait_answering(url, process, 30, context=trust)
        except (RuntimeError, TimeoutError) as exc:
            process.kill()
            said = log_path.read_bytes() if log_path else process.stdout.read()
            raise RuntimeError(f"{exc}: {said.decode(errors='replace')}") from None
        yield url
    finally:
        process.terminate()
        process.wait(timeout=15)
        if log_path:
            output.close()


@pytest.fixture(scope="module")
def checkpoint_flag(tiny_checkpoint):
    return ("--checkpoint", str(tiny_checkpoint))


@pytest.fixture(scope="module")
def voices(tiny_checkpoint):
    """The voices the served checkpoint has, as the gateway lists them."""
    return ", ".join(voices_in_checkpoint(tiny_checkpoint))


@pytest.fixture(scope="module")
def gateway(server, checkpoint_flag):
    with gateway_process(server.grpc_url, *checkpoint_flag) as url:
        yield url


@pytest.fixture(scope="module")
def user_audio():
    return read_wav(REPO_ROOT / "samples" / "user.wav")[: int(SECONDS * contract.SAMPLE_RATE)]


def ws_url(base: str, path: str) -> str:
    return base.replace("http://", "ws://") + path


def talker_active(server) -> float:
    """The talker's live conversations (0 before the gauge's first report)."""
    return scrape(server.metrics_url).get('personaplex_conversations_active{model="talker"}', 0.0)


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as reply:
        return reply.status, json.loads(reply.read())


# -- /v1/realtime ----------------------------------------------------------------------------


async def realtime_events_until(ws, predicate, timeout_s: float = 30.0) -> list:
    events = []
    async with asyncio.timeout(timeout_s):
        while True:
            message = await ws.receive()
            assert message.type == aiohttp.WSMsgType.TEXT, f"expected an event, got {message.type} {message.extra}"
            events.append(json.loads(message.data))
            if predicate(events[-1]):
                return events


def pcm16_b64(samples: np.ndarray) -> str:
    return base64.b64encode((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()).decode()


async def realtime_conversation(base: str, audio: np.ndarray, session: dict | None):
    """A paced conversation: session.update (if given), the audio in real time in 0.2 s appends,
    then every answer. Returns (events, agent samples, transcript)."""
    frames = len(audio) // FRAME
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(base, "/v1/realtime")) as ws:
        created = await realtime_events_until(ws, lambda e: True)
        assert created[0]["type"] == "session.created"
        events = []
        if session is not None:
            await ws.send_str(json.dumps({"type": "session.update", "session": session}))
            events += await realtime_events_until(ws, lambda e: e["type"] in ("session.updated", "error"))
            assert events[-1]["type"] == "session.updated", events[-1]
        start = time.perf_counter()

        async def send():
            for i, offset in enumerate(range(0, len(audio), CHUNK)):
                await asyncio.sleep(max(0.0, start + i * CHUNK / contract.SAMPLE_RATE - time.perf_counter()))
                await ws.send_str(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": pcm16_b64(audio[offset:offset + CHUNK])}))

        answered = 0

        def last_frame_or_error(e) -> bool:
            nonlocal answered
            answered += e["type"] == "response.output_audio.delta"
            return e["type"] == "error" or answered == frames

        sender = asyncio.ensure_future(send())
        events += await realtime_events_until(ws, last_frame_or_error)
        await sender
    audio_out = [np.frombuffer(base64.b64decode(e["delta"]), "<i2") for e in events
                 if e["type"] == "response.output_audio.delta"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    return events, audio_out, text


def test_realtime_conversation_gives_one_audio_frame_per_frame_in_and_text(gateway, user_audio):
    events, frames_out, text = asyncio.run(realtime_conversation(
        gateway, user_audio, {"voice": "NATF0", "instructions": "You enjoy having a good conversation.", "seed": 7}))
    assert not [e for e in events if e["type"] == "error"], events
    assert events[0]["type"] == "session.updated" and events[0]["session"]["voice"] == "NATF0"
    assert len(frames_out) == len(user_audio) // FRAME  # every whole frame answered, once
    assert all(f.size == FRAME for f in frames_out)
    assert np.abs(np.concatenate(frames_out)).max() > 100  # the agent's audio is not silence
    assert text.strip(), "no transcript delta in the whole conversation"


def test_realtime_starts_with_defaults_at_the_first_append(gateway, user_audio):
    events, frames_out, _ = asyncio.run(realtime_conversation(gateway, user_audio[: 10 * FRAME], None))
    assert [e["type"] for e in events][0] == "session.updated"
    assert len(frames_out) == 10


async def realtime_refusal(base: str, first: str | bytes, *, query: str = "") -> tuple[list, int, str]:
    """Send one message; the events that follow, and the close code and reason (None: still open)."""
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(base, "/v1/realtime" + query)) as ws:
        await realtime_events_until(ws, lambda e: e["type"] == "session.created")
        await (ws.send_bytes(first) if isinstance(first, bytes) else ws.send_str(first))
        events = await realtime_events_until(ws, lambda e: e["type"] in ("error", "session.updated"))
        closing = await ws.receive(timeout=5) if events[-1]["type"] == "error" else None
        return events, ws.close_code, (closing.extra if closing is not None else None)


def test_realtime_unknown_voice_and_bad_events_are_errors_that_keep_the_socket(gateway, voices):
    async def run():
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(gateway, "/v1/realtime")) as ws:
            await realtime_events_until(ws, lambda e: e["type"] == "session.created")
            errors = []
            for message in ('{"type": "session.update", "session": {"voice": "NOPE"}}', "{not json",
                            '{"type": "response.create"}', '{"type": "input_audio_buffer.append", "audio": "@@"}'):
                await ws.send_str(message)
                errors += await realtime_events_until(ws, lambda e: e["type"] == "error")
            await ws.send_str('{"type": "session.update", "session": {"voice": "NATM0"}}')
            ready = await realtime_events_until(ws, lambda e: e["type"] == "session.updated")
            return errors, ready[-1]

    errors, ready = asyncio.run(run())
    assert [e["error"]["code"] for e in errors] == ["unknown_voice", "invalid_event", "unsupported_event", "invalid_audio"]
    assert f"unknown voice 'NOPE'; this server has: {voices}" in errors[0]["error"]["message"]
    assert ready["session"]["voice"] == "NATM0"


def test_realtime_oversize_message_is_refused_with_an_error_then_closed(gateway):
    events, code, reason = asyncio.run(realtime_refusal(gateway, "x" * (200 * 1024)))
    assert events[-1]["error"]["code"] == "message_too_large"
    assert code == 1009 and "over the gateway's limit of 131072 bytes" in reason


def test_realtime_audio_faster_than_real_time_is_refused(gateway):
    async def run():
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(gateway, "/v1/realtime")) as ws:
            await realtime_events_until(ws, lambda e: e["type"] == "session.created")
            chunk = pcm16_b64(np.zeros(CHUNK, np.float32))
            for _ in range(30):  # 6 s at once; the gateway holds 1 s of burst and 3 s ahead
                await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            events = await realtime_events_until(ws, lambda e: e["type"] == "error")
            closing = await ws.receive(timeout=5)
            return events[-1], ws.close_code, closing.extra

    error, code, reason = asyncio.run(run())
    assert error["error"]["code"] == "audio_too_fast" and code == 1008 and "faster than real time" in reason


def test_a_client_that_reads_nothing_is_ended_and_its_slot_freed(server, checkpoint_flag, tmp_path):
    """A client that talks in real time but never reads its socket: the agent's answers fill
    its buffers, then would pile up in the gateway for as long as it talks. Past
    --unsent-max-s of them the gateway ends the conversation (client_too_slow), drops a socket
    that reads not even the close, and frees the conversation's Triton slot."""
    log = tmp_path / "gateway.log"

    def small_receive_buffer(addr_info):  # set before connecting: the kernel holds 4 KB, not megabytes
        family, kind, proto, *_ = addr_info
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        return sock

    with gateway_process(server.grpc_url, *checkpoint_flag, "--unsent-max-s", "0.5", log_path=log) as base:
        async def run():
            connector = aiohttp.TCPConnector(socket_factory=small_receive_buffer)
            async with aiohttp.ClientSession(connector=connector) as http, \
                    http.ws_connect(ws_url(base, "/v1/realtime")) as ws:
                await realtime_events_until(ws, lambda e: e["type"] == "session.created")
                await ws.send_str(json.dumps({"type": "session.update", "session": {"voice": "NATF0"}}))
                await realtime_events_until(ws, lambda e: e["type"] == "session.updated")
                chunk = pcm16_b64(np.zeros(CHUNK, np.float32))
                start = time.perf_counter()
                for i in range(int(30 * contract.SAMPLE_RATE / CHUNK)):  # up to 30 s of talk, no reading
                    if b"client_too_slow" in log.read_bytes():
                        return time.perf_counter() - start
                    await asyncio.sleep(max(0.0, start + i * CHUNK / contract.SAMPLE_RATE - time.perf_counter()))
                    try:
                        await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
                    except ConnectionError:
                        break
                return None

        talked_s = asyncio.run(run())
        assert talked_s is not None, f"never ended: {log.read_text()[-2000:]}"
        assert "refused (client_too_slow): the client has left" in log.read_text()
        deadline = time.monotonic() + 30  # the error's and the close's waits, then the end of the sequence
        while time.monotonic() < deadline and (get_json(base + "/stats")[1]["conversations_open"]
                                               or talker_active(server)):
            time.sleep(0.5)
        assert get_json(base + "/stats")[1]["conversations_open"] == 0
        assert talker_active(server) == 0  # this module's conversations are each over when their test ends


# -- /api/chat -------------------------------------------------------------------------------


def opus_pages(audio: np.ndarray) -> list[bytes]:
    """The audio as the Ogg/Opus bytes a client would send, one piece per 80 ms frame (some empty)."""
    writer = sphn.OpusStreamWriter(contract.SAMPLE_RATE)
    return [bytes(writer.append_pcm(audio[i:i + FRAME])) for i in range(0, len(audio), FRAME)]


async def chat_conversation(base: str, audio: np.ndarray, query: str):
    """Handshake, then the audio as Opus in real time, reading until the agent's audio covers
    all but the last 2 frames (the Opus writer holds back a partial page). Returns the kinds
    of message seen, the decoded agent samples, the text."""
    reader, pcm, text, kinds = sphn.OpusStreamReader(contract.SAMPLE_RATE), [], [], []
    want = (len(audio) // FRAME - 2) * FRAME
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(base, "/api/chat" + query)) as ws:
        first = await ws.receive(timeout=30)
        assert first.type == aiohttp.WSMsgType.BINARY and first.data == b"\x00", first
        start = time.perf_counter()

        async def send():
            for i, page in enumerate(opus_pages(audio)):
                await asyncio.sleep(max(0.0, start + i * FRAME_S - time.perf_counter()))
                if page:
                    await ws.send_bytes(b"\x01" + page)

        sender = asyncio.ensure_future(send())
        async with asyncio.timeout(30):
            while sum(p.size for p in pcm) < want:
                message = await ws.receive()
                assert message.type == aiohttp.WSMsgType.BINARY, message
                kinds.append(message.data[0])
                if message.data[0] == 1:
                    pcm.append(np.asarray(reader.append_bytes(message.data[1:]), np.float32))
                elif message.data[0] == 2:
                    text.append(message.data[1:].decode())
        await sender
    return kinds, np.concatenate(pcm), "".join(text)


def test_chat_conversation_streams_opus_both_ways_and_text(gateway, user_audio):
    before = get_json(gateway + "/stats")[1]["frames_out"]
    kinds, pcm, text = asyncio.run(chat_conversation(
        gateway, user_audio, "?text_prompt=You%20enjoy%20having%20a%20good%20conversation.&voice_prompt=NATF0.pt"
                             "&seed=7&text_temperature=0.7&text_topk=25&audio_temperature=0.8&audio_topk=250"
                             "&pad_mult=0&repetition_penalty=1.0&repetition_penalty_context=64&text_seed=1&audio_seed=2"))
    assert set(kinds) <= {1, 2} and 1 in kinds
    assert np.abs(pcm).max() > 0.003  # the agent's audio came through the codec, not silence
    assert text.strip()
    frames_out = get_json(gateway + "/stats")[1]["frames_out"] - before
    assert len(user_audio) // FRAME - 2 <= frames_out <= len(user_audio) // FRAME


async def chat_refusal(base: str, query: str, send: bytes | None = None):
    """The messages up to the close, and the close code and reason."""
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(base, "/api/chat" + query)) as ws:
        if send is not None:
            assert (await ws.receive(timeout=30)).data == b"\x00"
            await ws.send_bytes(send)
        messages = []
        async with asyncio.timeout(30):
            while True:
                message = await ws.receive()
                if message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                    return messages, ws.close_code, message.extra
                messages.append(message.data)


def test_chat_unknown_voice_gets_an_error_kind_and_a_close_reason(gateway, voices):
    messages, code, reason = asyncio.run(chat_refusal(gateway, "?voice_prompt=NOPE.pt&text_prompt="))
    assert messages == [f"\x05unknown voice 'NOPE'; this server has: {voices}".encode()]
    assert code == 1008 and reason.startswith("unknown voice 'NOPE'")


def test_chat_voice_the_server_does_not_have_is_refused_with_the_servers_words(server):
    with gateway_process(server.grpc_url, "--voices", "NATF0,GHOST") as base:
        messages, code, reason = asyncio.run(chat_refusal(base, "?voice_prompt=GHOST.pt"))
    assert messages[0][:1] == b"\x05" and b"unknown voice 'GHOST'" in messages[0]
    assert code == 1008 and "GHOST" in reason


def test_chat_sampling_setting_out_of_the_talkers_range_is_refused_with_its_words(gateway):
    messages, code, reason = asyncio.run(chat_refusal(gateway, "?voice_prompt=NATF0.pt&audio_topk=9999"))
    assert messages[0][:1] == b"\x05" and b"TOP_K must lie in [1, 500], got 9999" in messages[0]
    assert code == 1008 and "TOP_K" in reason


def test_chat_bad_kind_and_oversize_message_are_refused(gateway):
    messages, code, reason = asyncio.run(chat_refusal(gateway, "?voice_prompt=NATF0.pt", send=b"\x09hello"))
    assert messages[-1].startswith(b"\x05message kind 0x09 is not accepted") and code == 1003
    messages, code, reason = asyncio.run(chat_refusal(gateway, "?voice_prompt=NATF0.pt", send=b"\x01" + bytes(200_000)))
    assert messages[-1].startswith(b"\x05a message of 200001 bytes is over") and code == 1009


# moshi's own client (moshi.client, PyPI moshi 0.2.13), unchanged, with a stand-in for the sound
# card (it imports sounddevice, absent here): the "microphone" plays user.wav one block of 1920
# samples every 80 ms, the "speaker" keeps what it is given. Run in a process of its own.
MOSHI_CLIENT = """
import asyncio, json, sys, threading, time, types
import numpy as np
from personaplex_stream.audio import read_wav

user = read_wav(sys.argv[2])
played = []

class Stream:
    def __init__(self, samplerate, channels, blocksize, callback):
        self.blocksize, self.callback, self.running = blocksize, callback, False
    def __enter__(self):
        self.running = True
        threading.Thread(target=self.run, daemon=True).start()
        return self
    def __exit__(self, *exc):
        self.running = False
    def run(self):
        start, i = time.perf_counter(), 0
        while self.running:
            time.sleep(max(0.0, start + i * 0.08 - time.perf_counter()))
            self.block(i)
            i += 1

class InputStream(Stream):
    def block(self, i):
        frame = user[i * self.blocksize:(i + 1) * self.blocksize]
        frame = np.pad(frame, (0, self.blocksize - frame.size)).reshape(-1, 1).astype(np.float32)
        self.callback(frame, self.blocksize, None, None)

class OutputStream(Stream):
    def block(self, i):
        out = np.zeros((self.blocksize, 1), np.float32)
        self.callback(out, self.blocksize, None, None)
        played.append(out[:, 0].copy())

sys.modules["sounddevice"] = types.SimpleNamespace(InputStream=InputStream, OutputStream=OutputStream)
from moshi import client
from moshi.client_utils import RawPrinter

class Tokens(RawPrinter):
    text = ""
    def print_token(self, token):
        Tokens.text += token

args = types.SimpleNamespace(url=sys.argv[1], host=None, port=None, https=False)
try:
    asyncio.run(asyncio.wait_for(client.run(Tokens(), args), timeout=float(sys.argv[3])))
except asyncio.TimeoutError:
    pass
print(json.dumps({"blocks": len(played), "audible_blocks": int(sum(np.abs(b).max() > 1e-3 for b in played)),
                  "text": Tokens.text}))
"""


def test_moshis_own_client_talks_through_api_chat_unchanged(gateway, tmp_path):
    script = tmp_path / "moshi_client.py"
    script.write_text(MOSHI_CLIENT)
    run = subprocess.run([sys.executable, str(script), gateway, str(REPO_ROOT / "samples" / "user.wav"), "4"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    heard = json.loads(run.stdout.strip().splitlines()[-1])
    # about 50 blocks of 80 ms in 4 s; the agent's answers reach the speaker after the handshake
    assert heard["blocks"] >= 30 and heard["audible_blocks"] >= 10, (heard, run.stderr[-2000:])
    assert heard["text"].strip(), heard


# -- limits and access -----------------------------------------------------------------------


def test_too_many_connections_are_refused_clearly(server, checkpoint_flag):
    async def run(base):
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(base, "/v1/realtime")) as first:
            await realtime_events_until(first, lambda e: e["type"] == "session.created")
            async with http.ws_connect(ws_url(base, "/v1/realtime")) as second:
                refused = json.loads((await second.receive(timeout=10)).data)
                closing = await second.receive(timeout=10)
                return refused, second.close_code, closing.extra, get_json(base + "/stats")[1]

    with gateway_process(server.grpc_url, "--max-connections", "1", *checkpoint_flag) as base:
        refused, code, reason, stats = asyncio.run(run(base))
        after = get_json(base + "/stats")[1]
    assert refused["type"] == "error" and refused["error"]["code"] == "too_many_connections"
    assert code == 1013 and "the gateway is full" in reason
    assert stats["connection_cap"] == 1 and after["conversations_open"] == 0


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_disconnect_mid_conversation_ends_the_sequence_at_once(gateway, server, user_audio, how):
    """`close`: a close frame; `drop`: the TCP connection shut with no close frame (a tab killed)."""
    async def run():
        async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(gateway, "/v1/realtime")) as ws:
            await ws.send_str(json.dumps({"type": "session.update", "session": {"voice": "NATF0"}}))
            await realtime_events_until(ws, lambda e: e["type"] == "session.updated")
            await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_b64(user_audio[:CHUNK])}))
            await realtime_events_until(ws, lambda e: e["type"] == "response.output_audio.delta")
            during = talker_active(server)
            if how == "drop":
                ws.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
        # the client is gone without a word to the talker: the gateway's end request frees the slot
        deadline = time.monotonic() + 3
        while talker_active(server) >= during and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return during, talker_active(server), time.monotonic() - (deadline - 3)

    during, after, took_s = asyncio.run(run())
    assert during >= 1 and after == during - 1, f"the talker still holds the conversation after {took_s:.1f} s"


def test_token_and_origin_are_checked_before_the_upgrade(server, checkpoint_flag):
    async def attempt(base, query="", headers=None):
        async with aiohttp.ClientSession() as http:
            try:
                async with http.ws_connect(ws_url(base, "/v1/realtime" + query), headers=headers) as ws:
                    return (await ws.receive(timeout=10)).json()["type"]
            except aiohttp.WSServerHandshakeError as exc:
                return exc.status

    with gateway_process(server.grpc_url, "--token", "s3cret", "--origins", "https://app.example",
                         *checkpoint_flag) as base:
        assert asyncio.run(attempt(base)) == 401
        assert asyncio.run(attempt(base, "?token=wrong")) == 401
        assert asyncio.run(attempt(base, "?token=s3cret")) == "session.created"
        assert asyncio.run(attempt(base, headers={"Authorization": "Bearer s3cret"})) == "session.created"
        assert asyncio.run(attempt(base, "?token=s3cret", {"Origin": "https://evil.example"})) == 403
        assert asyncio.run(attempt(base, "?token=s3cret", {"Origin": "https://app.example"})) == "session.created"


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (openssl), valid a day."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate to serve TLS with")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def test_tls_serves_https_and_wss(server, checkpoint_flag, tmp_path):
    cert, key = self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=str(cert))

    async def run(base):
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "/healthz", ssl=trust) as reply:
                health = reply.status
            async with http.ws_connect(base.replace("https://", "wss://") + "/v1/realtime", ssl=trust) as ws:
                return health, (await ws.receive(timeout=10)).json()["type"]

    with gateway_process(server.grpc_url, "--tls-cert", str(cert), "--tls-key", str(key), *checkpoint_flag,
                         scheme="https", trust=trust) as base:
        assert asyncio.run(run(base)) == (200, "session.created")


def test_the_gateway_reaches_triton_over_tls(server, checkpoint_flag, user_audio, tmp_path):
    """Triton's gRPC behind Debian's nginx terminating TLS (as a TLS-serving Triton would be
    reached): the gateway's --triton-tls with the CA's certificate carries a conversation."""
    nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
    if nginx is None:
        pytest.skip("nginx is not installed (make deploy-deps installs Debian's)")
    cert, key = self_signed(tmp_path)
    port = free_port()
    (tmp_path / "nginx.conf").write_text(
        f"daemon off;\npid {tmp_path}/nginx.pid;\nerror_log {tmp_path}/error.log info;\nevents {{}}\n"
        f"http {{\n  access_log off;\n  client_body_temp_path {tmp_path};\n"
        f"  server {{\n    listen 127.0.0.1:{port} ssl http2;\n    ssl_certificate {cert};\n"
        f"    ssl_certificate_key {key};\n    location / {{ grpc_pass grpc://{server.grpc_url}; "
        f"grpc_read_timeout 1h; grpc_send_timeout 1h; }}\n  }}\n}}\n")
    proxy = subprocess.Popen([nginx, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with gateway_process(f"127.0.0.1:{port}", "--triton-tls", "--triton-ca", str(cert), *checkpoint_flag) as base:
            events, frames_out, _ = asyncio.run(realtime_conversation(base, user_audio[: 10 * FRAME], {"voice": "NATF0"}))
    finally:
        proxy.terminate()
        proxy.wait(timeout=15)
    assert not [e for e in events if e["type"] == "error"], events
    assert len(frames_out) == 10


def test_health_voices_and_the_page(gateway, voices):
    assert get_json(gateway + "/healthz")[0] == 200
    status, listed = get_json(gateway + "/api/voices")
    assert status == 200 and ", ".join(listed["voices"]) == voices and listed["default_voice"] == "NATF0"
    assert listed["default_prompt"]
    assert get_json(gateway + "/stats")[1]["connection_cap"] == 64  # the test server's pools are sized at load (auto)
    with urllib.request.urlopen(gateway + "/", timeout=5) as reply:
        assert reply.status == 200 and b"<html" in reply.read().lower()


def test_health_is_503_without_triton():
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{unused.getsockname()[1]}"
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "personaplex_gateway", "--triton-url", dead, "--port", str(port),
                                "--voices", "NATF0", "--max-connections", "2"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
                pytest.fail("healthz answered 200 with no Triton behind it")
            except urllib.error.HTTPError as exc:
                assert exc.code == 503
                break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None, "the gateway did not come up"
                time.sleep(0.2)
    finally:
        process.terminate()
        process.wait(timeout=15)
