"""End to end on a real `tritonserver` (the nvidia-pytriton build) with the real tritonclient."""

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from personaplex_stream import Persona, ServerError, stream_conversation
from personaplex_triton.core import audio, contract, loaders, tunables
from personaplex_triton.core.metrics import stage_setups
from polling import wait_for
from triton_requests import active, raw_request, voice_input

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[1]
FIVE_SECONDS = 63  # frames: 63 * 80 ms = 5.04 s
PROMPT = "You are a wise and friendly teacher. Answer questions or provide advice in a clear and engaging way."


def pool_size(server, model: str) -> int:
    """The slots the server's stage took (max_conversations is auto), from its metrics."""
    return stage_setups(server.metrics_url, expect=(model,))[model].slots


@pytest.fixture(scope="session")
def user_audio():
    return audio.read_wav(REPO_ROOT / "samples" / "user.wav")[: FIVE_SECONDS * contract.FRAME_SAMPLES]


@pytest.fixture(scope="session")
def solo(server, user_audio):
    """A 5 s conversation with sampling on, alone on the server."""
    return stream_conversation(user_audio, url=server.grpc_url,
                               persona=Persona(voice="NATF0", text_prompt=PROMPT, seed=1234))


@pytest.fixture(scope="session")
def in_process(server, tiny_checkpoint):
    """The same two stages run in this process, without Triton, at the server's pool sizes."""
    from personaplex_triton.lm.sampling import SamplingParams
    from personaplex_triton.mimi.runtime import open_step
    from personaplex_triton.stages.code2wav import Code2Wav, CodesFrame
    from personaplex_triton.stages.persona import PersonaLibrary
    from personaplex_triton.stages.talker import Talker, TalkerSetup

    files = loaders.resolve_checkpoint(tiny_checkpoint)
    tokenizer = loaders.get_tokenizer(files)
    talker = Talker(loaders.get_lm(files), open_step("encoder", files), tokenizer, pool_size(server, "talker"))
    decoder = Code2Wav(open_step("decoder", files), pool_size(server, "code2wav"))
    library = PersonaLibrary(files, tokenizer)

    def run(pcm, voice, prompt, seed):
        talker.prefill(0, TalkerSetup(library.persona(voice, prompt), SamplingParams(seed=seed)))
        decoder.prefill(0)
        frames = audio.split_frames(pcm)
        out, text = [], []
        while len(out) < len(frames):
            step = talker.tick({0: frames[len(out)]})[0]
            out.append(decoder.tick({0: CodesFrame(step.codes)})[0])
            text.append(talker.text_piece(step.text_token))
        talker.stop(0)
        return np.concatenate(out), text

    yield run
    talker.close()


def test_conversation_through_ensemble(solo, user_audio, in_process):
    n = FIVE_SECONDS
    assert solo.frames_sent == n and solo.frames_received == n
    assert solo.audio.shape == (n * contract.FRAME_SAMPLES,) and solo.audio.dtype == np.float32
    assert np.isfinite(solo.audio).all()
    assert np.sqrt(np.mean(solo.audio ** 2)) > 1e-3  # not silent
    assert len(solo.text_pieces) == n
    # Every frame, in order, is what the stages compute without Triton.
    expected_audio, expected_text = in_process(user_audio, "NATF0", PROMPT, 1234)
    assert solo.text_pieces == expected_text
    np.testing.assert_allclose(solo.audio, expected_audio, atol=1e-4)
    assert solo.first_audio_ms > 0 and solo.latency_ms_p95 >= solo.latency_ms_p50 > 0


def two_conversations_at_once(url: str, user_audio):
    """`solo`'s conversation and another (a voice prompt as the user's audio, another persona)
    at once: their results, and the other's audio."""
    other_audio = audio.read_wav(REPO_ROOT / "export" / "voice_prompts" / "NATM0.wav")
    results = {}

    def talk(name, pcm, persona):
        results[name] = stream_conversation(pcm, url=url, persona=persona)

    threads = [
        threading.Thread(target=talk, args=("a", user_audio, Persona(voice="NATF0", text_prompt=PROMPT, seed=1234))),
        threading.Thread(target=talk, args=("b", other_audio, Persona(voice="NATM0", text_prompt="Be brief.", seed=7))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results["a"], results["b"], other_audio


def test_two_conversations_at_once_are_isolated(server, solo, user_audio):
    a, b, other_audio = two_conversations_at_once(server.grpc_url, user_audio)
    assert a.frames_received == FIVE_SECONDS
    assert b.frames_received == len(audio.split_frames(other_audio))
    assert a.text_pieces == solo.text_pieces
    np.testing.assert_allclose(a.audio, solo.audio, atol=1e-4)
    assert not np.allclose(a.audio[: b.audio.size], b.audio, atol=1e-3)


def test_send_threads_answer_every_frame_in_order(tiny_checkpoint, solo, user_audio, tmp_path):
    """Both stages with `send_threads` 3 (each thread sending its own conversations' answers):
    two conversations at once get every frame, in order, the first exactly what it gets on the
    default server (one send thread)."""
    from personaplex_triton.serving import model_configs
    from personaplex_triton.serving.launch import TritonServer

    repository = tmp_path / "model_repository"  # written with a copy of the models (model_configs.write)
    model_configs.main(["--out", str(repository), "--set", "talker.send_threads=3", "--set", "code2wav.send_threads=3"])
    with TritonServer(repository, env={"PERSONAPLEX_CHECKPOINT": str(tiny_checkpoint)}) as server:
        a, b, other_audio = two_conversations_at_once(server.grpc_url, user_audio)
    assert a.frames_received == FIVE_SECONDS and b.frames_received == len(audio.split_frames(other_audio))
    assert a.text_pieces == solo.text_pieces
    np.testing.assert_allclose(a.audio, solo.audio, atol=1e-4)

def test_stages_in_processes_of_their_own_answer_every_frame_as_in_the_stubs(tiny_checkpoint, solo, user_audio,
                                                                               tmp_path):
    """`stage_process` true for both stages: each stub drives its stage in a child Python
    process (engine/stage_process.py). Two conversations at once get every frame, in order,
    the first exactly what the default server gives it; each stub has its stage's process as a
    child, and the server's graceful shutdown leaves none of them behind."""
    from personaplex_triton.serving import model_configs
    from personaplex_triton.serving.launch import TritonServer, child_processes

    repository = tmp_path / "model_repository"  # written with a copy of the models (model_configs.write)
    model_configs.main(["--out", str(repository), "--set", "talker.stage_process=true",
                        "--set", "code2wav.stage_process=true"])
    with TritonServer(repository, env={"PERSONAPLEX_CHECKPOINT": str(tiny_checkpoint)},
                      log_path=tmp_path / "tritonserver.log") as server:
        a, b, other_audio = two_conversations_at_once(server.grpc_url, user_audio)
        workers = {model: [pid for stub in server.stub_pids(model) for pid, argv in child_processes(stub).items()
                           if "personaplex_triton.engine.stage_process" in " ".join(argv)]
                   for model in ("talker", "code2wav")}
        setups = stage_setups(server.metrics_url, expect=("talker", "code2wav"))
    assert a.frames_received == FIVE_SECONDS and b.frames_received == len(audio.split_frames(other_audio))
    assert a.text_pieces == solo.text_pieces
    np.testing.assert_allclose(a.audio, solo.audio, atol=1e-4)
    assert all(len(pids) == 1 for pids in workers.values()), workers
    for pid in workers["talker"] + workers["code2wav"]:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    log = server.log_path.read_text()
    assert "talker: the stage runs in process" in log and "code2wav: the stage runs in process" in log
    # send_threads auto: several where the stage ticks in a process of its own
    assert {model: setup.send_threads for model, setup in setups.items()} == {
        "talker": tunables.STAGE_PROCESS_SEND_THREADS, "code2wav": tunables.STAGE_PROCESS_SEND_THREADS}


ONE_STUB_SETTINGS = {  # id: the speech model's parameters set
    "one tick, in the stub": [],  # as the repository is, on a CPU
    "one tick, in a process of its own": ["speech.stage_process=true"],  # as on a GPU
}


@pytest.mark.parametrize("settings", ONE_STUB_SETTINGS.values(), ids=ONE_STUB_SETTINGS.keys())
def test_one_stub_repository_answers_every_frame_as_two_stubs(tiny_checkpoint, solo, user_audio, tmp_path, settings):
    """model_repository_one_stub (both stages in one stub, `speech`, behind the same `ensemble`):
    two conversations at once get every frame, in order, the first exactly what the two-stub
    server gives it; its metrics give both stages' pools, send threads and Mimi runtimes (as the
    bench reads them), its log the same for people. One engine's tick steps both stages, with
    `stage_process` in the stub's one child process."""
    from personaplex_triton.core.paths import ONE_STUB_REPOSITORY
    from personaplex_triton.serving import model_configs
    from personaplex_triton.serving.launch import TritonServer, child_processes

    repository = ONE_STUB_REPOSITORY
    if settings:
        repository = tmp_path / "model_repository_one_stub"  # written with a copy of the models (model_configs.write)
        model_configs.main(["--one-stub", "--out", str(repository), *(f"--set={item}" for item in settings)])
    with TritonServer(repository, env={"PERSONAPLEX_CHECKPOINT": str(tiny_checkpoint)},
                      log_path=tmp_path / "tritonserver.log") as server:
        a, b, other_audio = two_conversations_at_once(server.grpc_url, user_audio)
        assert len(server.stub_pids()) == 1
        workers = [pid for pid, argv in child_processes(server.stub_pids()[0]).items()
                   if "personaplex_triton.engine.stage_process" in " ".join(argv)]
        log = server.log_path.read_text()
        setups = stage_setups(server.metrics_url, expect=("talker", "code2wav"))
    assert a.frames_received == FIVE_SECONDS and b.frames_received == len(audio.split_frames(other_audio))
    assert a.text_pieces == solo.text_pieces
    np.testing.assert_allclose(a.audio, solo.audio, atol=1e-4)
    assert set(setups) == {"talker", "code2wav"} and all(setup.slots >= 1 for setup in setups.values())
    assert {model: (setup.mimi_part, setup.mimi_runtime) for model, setup in setups.items()} == {
        "talker": ("encoder", "onnxruntime"), "code2wav": ("decoder", "onnxruntime")}
    assert "talker: Mimi encoder on" in log and "code2wav: Mimi decoder on" in log
    assert "one tick steps the talker and decodes its frames" in log
    if "speech.stage_process=true" in settings:
        assert len(workers) == 1 and "speech: the stage runs in process" in log
        assert {model: setup.send_threads for model, setup in setups.items()} == {
            "talker": tunables.STAGE_PROCESS_SEND_THREADS, "code2wav": tunables.STAGE_PROCESS_SEND_THREADS}
    else:
        assert workers == []  # auto, on a CPU: the stages tick in the stub
        assert {model: setup.send_threads for model, setup in setups.items()} == {"talker": 1, "code2wav": 1}


@pytest.mark.parametrize("change", [dict(seed=99), dict(voice="NATM0"), dict(text_prompt="Talk about cooking.")])
def test_persona_controls_change_output(server, solo, user_audio, change):
    persona = Persona(**{**dict(voice="NATF0", text_prompt=PROMPT, seed=1234), **change})
    short = user_audio[: 12 * contract.FRAME_SAMPLES]
    result = stream_conversation(short, url=server.grpc_url, persona=persona)
    assert result.frames_received == 12
    assert not np.allclose(result.audio, solo.audio[: short.size], atol=1e-3)


def test_bad_input_is_refused_without_disturbing_others(server, solo, user_audio):
    healthy = {}
    thread = threading.Thread(target=lambda: healthy.update(r=stream_conversation(
        user_audio, url=server.grpc_url, persona=Persona(voice="NATF0", text_prompt=PROMPT, seed=1234))))
    thread.start()
    _, error = raw_request(server, np.zeros(1000, np.float32), 501, True, True)
    assert "whole number of 1920-sample frames" in error
    _, error = raw_request(server, np.zeros(1920, np.float32), 502, True, True, [voice_input("NOBODY")])
    assert "unknown voice 'NOBODY'" in error and "NATF0" in error
    _, error = raw_request(server, np.zeros(2 * 1920, np.float32), 506, True, True)
    assert "sequence-end request carries at most one frame, got 2" in error
    _, error = raw_request(server, np.full(1920, np.nan, np.float32), 503, True, True)
    assert "NaN" in error
    _, error = raw_request(server, np.zeros(1920, np.float32), 504, False, True)
    assert "must specify the START flag" in error  # Triton's sequence batcher
    _, error = raw_request(server, np.zeros(1920, np.float32), 505, True, False, [voice_input("NOBODY")])
    assert "unknown voice" in error
    _, error = raw_request(server, np.zeros(1920, np.float32), 505, False, True)
    assert "not open" in error  # a failed start leaves no half-made conversation
    with pytest.raises(ServerError, match=r"must lie in \[-1, 1\]"):
        stream_conversation(np.full(1920 * 2, 3.0, np.float32), url=server.grpc_url)
    thread.join()
    r = healthy["r"]
    assert r.frames_received == FIVE_SECONDS
    assert r.text_pieces == solo.text_pieces
    np.testing.assert_allclose(r.audio, solo.audio, atol=1e-4)


def test_several_frames_per_request_and_an_empty_end(server):
    frames = np.random.default_rng(0).uniform(-0.5, 0.5, 3 * contract.FRAME_SAMPLES).astype(np.float32)
    for _ in range(2):  # the id is free again once its sequence ended
        responses, error = raw_request(server, frames, 601, True, False, [voice_input("NATF0")])
        assert error is None
        assert len(responses) == 3
        assert all(r.as_numpy(contract.AUDIO_OUT).shape == (contract.FRAME_SAMPLES,) for r in responses)
        responses, error = raw_request(server, np.zeros(0, np.float32), 601, False, True)
        assert error is None and responses == []


def test_an_empty_end_ends_the_triton_sequence_of_a_refused_start(server):
    frame = np.zeros(contract.FRAME_SAMPLES, np.float32)
    _, error = raw_request(server, frame, 507, True, False, [voice_input("NOBODY")])
    assert "unknown voice" in error
    _, error = raw_request(server, frame, 507, False, False)
    assert "not open" in error  # Triton still holds the sequence: the talker refuses its frame
    responses, error = raw_request(server, np.zeros(0, np.float32), 507, False, True)
    assert error is None and responses == []  # nothing to end: no error
    _, error = raw_request(server, frame, 507, False, True)
    assert "must specify the START flag" in error  # Triton's sequence batcher: the sequence ended


def test_a_client_that_fails_mid_conversation_ends_it_at_once(server, user_audio):
    def hang_up(frame):
        if frame.index == 3:
            raise KeyboardInterrupt  # as a caller's Ctrl-C, between two frames (real time: none in flight)
    with pytest.raises(KeyboardInterrupt):
        stream_conversation(user_audio, url=server.grpc_url, sequence_id=508, realtime=True, on_frame=hang_up)
    # its end went out before the stream closed: Triton's sequence is over, the talker's slot
    # free well before the 60 s idle timeout
    _, error = raw_request(server, np.zeros(contract.FRAME_SAMPLES, np.float32), 508, False, True)
    assert "must specify the START flag" in error
    assert wait_for(lambda: active(server) == 0, 10)


def test_cli_streams_any_wav_and_reports_json(server, tmp_path):
    """The installed `personaplex-stream` command: 44.1 kHz stereo in, 24 kHz mono out."""
    from scipy.io import wavfile

    rate = 44100
    stereo = np.random.default_rng(1).uniform(-0.3, 0.3, (rate, 2))  # 1 s
    wavfile.write(tmp_path / "in.wav", rate, np.round(stereo * 32767).astype(np.int16))
    out = tmp_path / "agent.wav"
    script = Path(sys.executable).parent / "personaplex-stream"
    run = subprocess.run([str(script), "--input", str(tmp_path / "in.wav"), "--output", str(out),
                          "--url", server.grpc_url, "--voice", "NATM0", "--seed", "3", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    frames = -(-contract.SAMPLE_RATE // contract.FRAME_SAMPLES)  # 1 s -> 13 frames, last padded
    assert summary["frames_sent"] == summary["frames_received"] == frames
    for key in ("first_audio_ms", "latency_ms_p50", "latency_ms_p95", "text"):
        assert key in summary
    agent = audio.read_wav(out)
    assert agent.size == frames * contract.FRAME_SAMPLES and np.abs(agent).max() > 0
    assert out.with_suffix(".txt").read_text().strip() == summary["text"].strip()


def test_realtime_pacing(server):
    frames = 10
    pcm = np.random.default_rng(2).uniform(-0.3, 0.3, frames * contract.FRAME_SAMPLES).astype(np.float32)
    result = stream_conversation(pcm, url=server.grpc_url, persona=Persona(voice="NATF0", seed=1), realtime=True)
    assert result.frames_received == frames
    # one frame per 80 ms on an absolute schedule, although this server answers slower
    drift = np.array(result.send_offsets_s) - 0.080 * np.arange(frames)
    # A 2-core machine shared with other work delays sends (83 ms seen), but lateness never
    # accumulates: paced by the server's answers instead, the 10th send would be about 0.8 s late.
    assert np.median(np.abs(drift)) < 0.05
    assert abs(drift[-1]) < 0.25


def test_each_stage_reports_what_it_took_at_load(server):
    """Its pool, send threads, Mimi runtime and (the talker) warm personas and KV dtype, as
    metrics of its model; the log says the same for people."""
    setups = stage_setups(server.metrics_url, expect=("talker", "code2wav"))
    # auto on a CPU with `make export` done: ONNX Runtime for both halves of Mimi.
    assert {model: (setup.mimi_part, setup.mimi_runtime) for model, setup in setups.items()} == {
        "talker": ("encoder", "onnxruntime"), "code2wav": ("decoder", "onnxruntime")}
    talker, code2wav = setups["talker"], setups["code2wav"]
    assert talker.slots >= 1 and code2wav.slots >= talker.slots and talker.send_threads == code2wav.send_threads == 1
    assert talker.kv_dtype == "float32" and code2wav.kv_dtype is None and code2wav.warm_personas == ()
    # warm_personas "all": every voice of the checkpoint the talker's persona cache holds
    assert "NATF0" in talker.warm_personas
    log = server.log_path.read_text()
    assert f"talker: {talker.slots} conversation slots (" in log
    assert "talker: personas prefilled at load: " in log


def test_each_prefill_is_recorded_and_logged(server, solo):
    """Each prefill an engine ran is a typed record in the server's traces (trace.read_prefills):
    its conversations, its chunks and the longest (how long the live conversations' frames
    waited for it), within its whole; the engine's log line for people reaches tritonserver's log
    at its level (before, the stub dropped INFO records)."""
    import time

    from personaplex_triton.core.trace import read_prefills

    prefills = read_prefills(server.trace_dir)
    assert {prefill.stage for prefill in prefills} == {"talker", "code2wav"}
    assert [prefill.ended for prefill in prefills] == sorted(prefill.ended for prefill in prefills)
    assert all(prefill.conversations >= 1 and prefill.chunks >= 1 and prefill.live >= 1
               and prefill.begin_s + sum(prefill.chunks_s) <= prefill.duration_s
               and time.time() - 3600 < prefill.began <= prefill.ended <= time.time() for prefill in prefills)
    # a new persona's prefill (the solo conversation's voice and role prompt) takes chunks
    assert max(prefill.chunks for prefill in read_prefills(server.trace_dir, "talker")) > 1
    assert "personaplex_triton.engine.engine_loop: talker: prefilled 1 conversation(s) in " in server.log_path.read_text()


def test_code2wavs_stub_writes_its_send_backlog_where_the_talkers_stub_reads_it(server):
    """In two stubs the talker's admission counts code2wav's send backlog (sends_gauge.py):
    code2wav's stub writes it at each heartbeat, under the name of the server both stubs run in."""
    import struct
    import time

    from personaplex_triton.engine.scheduler import SENDS_BEHIND_LIMIT_S
    from personaplex_triton.serving.sends_gauge import STALE_S, gauge_folder, sends_behind_reader

    server_pid = server.tritonserver_pid()
    files = list(gauge_folder().glob(f"personaplex-{server_pid}-code2wav-*.sends-behind"))
    assert len(files) == 1  # one code2wav instance
    behind_s, written = struct.unpack("=dd", files[0].read_bytes())
    assert 0 <= behind_s < SENDS_BEHIND_LIMIT_S and time.monotonic() - written < STALE_S  # idle, and beating
    assert 0 <= sends_behind_reader("code2wav", server_pid)() < SENDS_BEHIND_LIMIT_S
    assert not list(gauge_folder().glob(f"personaplex-{server_pid}-talker-*"))  # the talker's no stub reads
