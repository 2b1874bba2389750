"""The gateway's pure parts: framing, PCM16, pacing and caps, the two protocols' parsing, voices,
access checks. No server: tests/test_gateway.py runs the gateway against a real tritonserver."""

import base64
import json
import tarfile

import numpy as np
import pytest

from personaplex_gateway import app, chat_protocol, realtime_protocol
from personaplex_gateway.conversation import close_reason
from personaplex_gateway.triton_session import _error_code
from personaplex_gateway.framing import FrameBuffer, float_to_pcm16, pcm16_to_float
from personaplex_gateway.limits import AudioPacer, ConnectionGate, GatewayError, Limits
from personaplex_gateway.voices import VoiceCatalog, voice_name, voices_in_checkpoint

VOICES = VoiceCatalog.of(["NATF0", "NATM0"])


def test_frame_buffer_cuts_any_chunks_into_whole_frames_in_order():
    samples = np.linspace(-1, 1, 5000, dtype=np.float32)
    buffer, frames = FrameBuffer(), []
    for start, stop in ((0, 7), (7, 1920), (1920, 4500), (4500, 5000)):
        frames += buffer.push(samples[start:stop])
    assert [f.size for f in frames] == [1920, 1920]
    np.testing.assert_array_equal(np.concatenate(frames), samples[:3840])
    assert buffer.pending_samples == 5000 - 3840


def test_frame_buffer_clips_to_the_wire_contracts_range():
    frames = FrameBuffer().push(np.concatenate([np.full(960, 1.00003), np.full(960, -1.2)]).astype(np.float32))
    assert frames[0].max() == 1.0 and frames[0].min() == -1.0


def test_pcm16_round_trip_and_clipping():
    x = np.array([0.0, 0.5, -0.5, 1.5, -1.5], dtype=np.float32)
    back = pcm16_to_float(float_to_pcm16(x))
    np.testing.assert_allclose(back, [0.0, 0.5, -0.5, 32767 / 32768, -1.0], atol=1 / 32768)
    with pytest.raises(ValueError, match="even number of bytes"):
        pcm16_to_float(b"\x00\x01\x02")


def test_pacer_sends_the_burst_at_once_then_one_frame_every_80_ms():
    pacer = AudioPacer(burst_s=0.24, max_ahead_s=0.4)  # 3 frames of burst, 5 held back at most
    pacer.open(now=100.0, frames_waiting=0)
    pacer.arrive(0, 100.0)
    assert [pacer.due(i) for i in range(3)] == [100.0] * 3
    assert pacer.due(5) == pytest.approx(100.0 + 2 * 0.08)


def test_pacer_refuses_a_client_too_far_ahead_of_real_time_but_not_a_real_time_one():
    pacer = AudioPacer(burst_s=0.24, max_ahead_s=0.4)
    pacer.open(now=0.0, frames_waiting=0)
    for i in range(100):  # real time: frame i at i * 80 ms
        pacer.arrive(i, i * 0.08)
    fast = AudioPacer(burst_s=0.24, max_ahead_s=0.4)
    fast.open(now=0.0, frames_waiting=0)
    for i in range(8):  # burst 3 + 5 held back, all at once
        fast.arrive(i, 0.0)
    with pytest.raises(GatewayError, match="faster than real time") as refused:
        fast.arrive(8, 0.0)
    assert refused.value.code == "audio_too_fast"
    fast.arrive(8, 0.08)  # a frame's time later the next one is allowed


def test_pacer_bounds_what_arrives_before_the_session_is_ready():
    pacer = AudioPacer(burst_s=0.0, max_ahead_s=0.16)
    pacer.arrive(0, 5.0)
    pacer.arrive(1, 50.0)  # time does not count before ready
    with pytest.raises(GatewayError):
        pacer.arrive(2, 90.0)


def test_connection_gate_refuses_past_capacity_and_frees_on_leave():
    gate = ConnectionGate(2)
    gate.enter(), gate.enter()
    with pytest.raises(GatewayError, match="full") as refused:
        gate.enter()
    assert refused.value.code == "too_many_connections" and refused.value.close_code == 1013
    gate.leave()
    gate.enter()


def test_limits_name_a_bad_setting_and_an_oversize_message():
    with pytest.raises(ValueError, match="max_connections"):
        Limits(max_connections=0)
    with pytest.raises(ValueError, match="unsent_max_s must be > 0, got 0"):
        Limits(unsent_max_s=0)
    limits = Limits(max_message_bytes=2048)
    limits.check_message(2048)
    with pytest.raises(GatewayError, match="2049 bytes is over the gateway's limit of 2048") as refused:
        limits.check_message(2049)
    assert refused.value.close_code == 1009


def test_chat_query_applies_the_talkers_settings_and_accepts_the_web_clients_others():
    query = {"text_prompt": "You are a chef.", "voice_prompt": "NATM0.pt", "text_temperature": "0.7",
             "text_topk": "25", "audio_temperature": "0.8", "audio_topk": "250", "text_seed": "1",
             "audio_seed": "77", "pad_mult": "0", "repetition_penalty": "1.0", "repetition_penalty_context": "64",
             "worker_auth_id": "x", "email": "a@b.c"}
    persona = chat_protocol.persona_from_query(query, VOICES)
    assert (persona.voice, persona.text_prompt, persona.seed) == ("NATM0", "You are a chef.", 77)
    assert (persona.temperature, persona.top_k, persona.temperature_text, persona.top_k_text) == (0.8, 250, 0.7, 25)
    assert chat_protocol.persona_from_query({**query, "seed": "-1"}, VOICES).seed is None
    defaults = chat_protocol.persona_from_query({}, VOICES)
    assert (defaults.voice, defaults.text_prompt, defaults.seed) == ("NATF0", None, None)


@pytest.mark.parametrize("query, code, words", [
    ({"voice_prompt": "NOPE.pt"}, "unknown_voice", "unknown voice 'NOPE'; this server has: NATF0, NATM0"),
    ({"voice_prompt": "../etc/passwd"}, "unknown_voice", "a voice is a name"),
    ({"seed": "seven"}, "invalid_parameter", "seed must be an integer"),
    ({"audio_topk": "1.5"}, "invalid_parameter", "audio_topk must be an integer"),
    ({"text_temperature": "hot"}, "invalid_parameter", "text_temperature must be a number"),
])
def test_chat_query_names_a_bad_parameter(query, code, words):
    with pytest.raises(GatewayError) as refused:
        chat_protocol.persona_from_query(query, VOICES)
    assert refused.value.code == code and words in refused.value.message


def test_chat_message_kinds():
    assert chat_protocol.message_kind(b"\x01ogg") == (1, b"ogg")
    assert chat_protocol.message_kind(b"\x06") == (6, b"")  # a ping: ignored, not refused
    for bad in (b"\x02hello", b"\x09"):
        with pytest.raises(GatewayError, match=f"kind 0x{bad[0]:02x} is not accepted") as refused:
            chat_protocol.message_kind(bad)
        assert refused.value.code == "bad_kind" and refused.value.close_code == 1003
    with pytest.raises(GatewayError, match="empty message"):
        chat_protocol.message_kind(b"")


def test_realtime_events_parse_and_refuse_clearly():
    assert realtime_protocol.parse_event('{"type": "session.update"}')["type"] == "session.update"
    for bad in ("not json", "[1]", '{"type": 3}'):
        with pytest.raises(GatewayError) as refused:
            realtime_protocol.parse_event(bad)
        assert refused.value.code == "invalid_event" and refused.value.close_code is None
    persona = realtime_protocol.persona_from_session({"instructions": "Be brief.", "voice": "NATM0", "seed": 3,
                                                      "modalities": ["audio"]}, VOICES)
    assert (persona.voice, persona.text_prompt, persona.seed) == ("NATM0", "Be brief.", 3)
    nested = realtime_protocol.persona_from_session({"audio": {"output": {"voice": "NATM0"}}}, VOICES)
    assert nested.voice == "NATM0"
    for session, words in (({"seed": "3"}, "session.seed"), ({"voice": "X"}, "unknown voice"),
                           ({"instructions": 5}, "instructions")):
        with pytest.raises(GatewayError, match=words):
            realtime_protocol.persona_from_session(session, VOICES)


def test_realtime_audio_append_is_base64_pcm16():
    pcm = float_to_pcm16(np.full(10, 0.25, np.float32))
    samples = realtime_protocol.audio_of({"audio": base64.b64encode(pcm).decode()})
    np.testing.assert_allclose(samples, 0.25, atol=1e-4)
    for bad in ({"audio": "***"}, {"audio": base64.b64encode(b"abc").decode()}, {}):
        with pytest.raises(GatewayError) as refused:
            realtime_protocol.audio_of(bad)
        assert refused.value.code == "invalid_audio"


def test_realtime_error_event_shape():
    event = json.loads(realtime_protocol.error_event(GatewayError("audio_too_fast", "too fast")))
    assert event["type"] == "error" and event["error"]["code"] == "audio_too_fast"
    assert event["error"]["message"] == "too fast" and event["event_id"].startswith("event_")


def test_voices_from_a_checkpoint_folder_or_its_archive(tmp_path):
    (tmp_path / "a" / "voices").mkdir(parents=True)
    for name in ("NATF1.pt", "NATF1.wav", "VARM0.pt", "notes.txt"):
        (tmp_path / "a" / "voices" / name).write_bytes(b"")
    assert voices_in_checkpoint(tmp_path / "a") == ["NATF1", "VARM0"]
    (tmp_path / "b").mkdir()
    with tarfile.open(tmp_path / "b" / "voices.tgz", "w:gz") as archive:
        archive.add(tmp_path / "a" / "voices", arcname="voices")
    assert voices_in_checkpoint(tmp_path / "b") == ["NATF1", "VARM0"]
    with pytest.raises(ValueError, match="no voices/ folder"):
        voices_in_checkpoint(tmp_path)
    assert voice_name("NATF2.pt") == "NATF2" and voice_name("NATF2") == "NATF2"
    assert VoiceCatalog.of(["VARM0", "NATF1"]).default_voice == "VARM0"
    assert VoiceCatalog().resolve("ANY") == "ANY"  # voices unknown here: the server judges


def test_origin_allow_list():
    assert app.origin_allowed(None, "gw:8080", ())  # no Origin: not a browser
    assert app.origin_allowed("http://gw:8080", "gw:8080", ())  # same origin
    assert not app.origin_allowed("http://evil.example", "gw:8080", ())
    assert app.origin_allowed("https://app.example", "gw:8080", ("https://app.example",))
    assert not app.origin_allowed("http://gw:8080", "gw:8080", ("https://app.example",))
    assert app.origin_allowed("http://evil.example", "gw:8080", ("*",))


def test_close_reason_fits_a_close_frame_in_whole_characters():
    reason = close_reason("é" * 100)
    assert len(reason) <= 123 and reason.decode("utf-8") == "é" * 61


def test_cli_flags_make_the_config_and_name_bad_combinations(tmp_path):
    from personaplex_gateway import cli

    config = cli.config_of(cli.parse_args(["--voices", "NATM0, NATF0", "--origins", "https://a.example/,https://b.example",
                                           "--token", "t", "--max-connections", "3", "--triton-tls",
                                           "--triton-ca", "ca.pem"]))
    assert config.voices.names == ("NATM0", "NATF0") and config.voices.default_voice == "NATF0"
    assert config.origins == ("https://a.example", "https://b.example") and config.token == "t"
    assert config.max_connections == 3 and config.triton_tls.root_certificates == "ca.pem"
    assert cli.config_of(cli.parse_args(["--voices", "NATF0"])).triton_tls is None
    for argv, words in ((["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
                        (["--triton-client-cert", "c.pem"], "--triton-client-cert and --triton-client-key"),
                        (["--static", str(tmp_path)], "has no index.html"),
                        (["--checkpoint", str(tmp_path)], "no voices/ folder")):
        with pytest.raises(ValueError, match=words):
            cli.config_of(cli.parse_args(["--voices", "NATF0"] * ("--checkpoint" not in argv) + argv))


@pytest.mark.parametrize("message, code", [
    ("at capacity: all 71 conversation slots are busy; try again later", "server_full"),
    ("at capacity: 70 live conversations and one more would settle at 40 ms ticks (the limit is 32 ms, ...)",
     "server_full"),
    ("unknown voice 'X'", "unknown_voice"),
    ("internal error while stepping: boom", "server_error"),
])
def test_the_servers_refusals_map_to_error_codes(message, code):
    assert _error_code(message)[0] == code


def test_the_gateway_imports_neither_the_server_library_nor_torch():
    import subprocess
    import sys

    modules = ("personaplex_gateway.cli", "personaplex_gateway.app")
    code = (f"import sys; import {', '.join(modules)}; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'personaplex_triton', 'torch', 'scipy'}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
