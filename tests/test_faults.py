"""The fault suite, against a real `tritonserver`: malformed and over-limit requests, internal
faults injected next to a healthy conversation, a vanished client, the metrics, a killed stub
process, and SIGTERM with conversations open. Each healthy conversation must lose nothing: it is compared frame by
frame with the same conversation run alone. Every test runs against both model repositories:
the two stages in two stubs, and both in one (`speech`)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from personaplex_stream import Persona, ServerError, is_final_response, stream_conversation
from personaplex_triton.core import contract, tunables
from personaplex_triton.core.metrics import scrape, series_labels
from personaplex_triton.core.paths import MODEL_REPOSITORY, ONE_STUB_REPOSITORY
from personaplex_triton.serving import health, model_configs
from personaplex_triton.serving.launch import TritonServer, child_processes
from polling import wait_for
from triton_requests import active, raw_request, tensor, voice_input

pytestmark = pytest.mark.integration

IDLE_TIMEOUT_S = 10  # long enough for a slow client between two requests on a busy machine
FAULTS = {"tick": 7001, "flaky-tick": 7002, "send": 7003}
HEALTHY = Persona(voice="NATF0", text_prompt="Be kind.", seed=5)
FRAME = np.zeros(contract.FRAME_SAMPLES, np.float32)
# The model repositories, each with its models that run in a Python stub, the talker's first.
REPOSITORIES = {label: (home, tuple(m for m in model_configs.REPOSITORIES[home] if m != contract.MODEL_NAME))
                for label, home in (("two-stubs", MODEL_REPOSITORY), ("one-stub", ONE_STUB_REPOSITORY))}


@pytest.fixture(scope="module", params=REPOSITORIES)
def faulty(request, tiny_checkpoint, tmp_path_factory):
    """A server whose talker closes idle conversations after IDLE_TIMEOUT_S and injects the
    FAULTS; `stub_models` are its models that run in a Python stub, the talker's first."""
    home, stub_models = REPOSITORIES[request.param]
    root = tmp_path_factory.mktemp("faults")
    repository = root / "model_repository"
    shutil.copytree(home, repository, ignore=shutil.ignore_patterns("__pycache__"))
    config = repository / stub_models[0] / "config.pbtxt"
    text, count = re.subn(r'(key: "idle_timeout_s" value: \{ string_value: ")[^"]*"', rf'\g<1>{IDLE_TIMEOUT_S}"',
                          config.read_text())
    assert count == 1
    config.write_text(text)
    env = {"PERSONAPLEX_CHECKPOINT": str(tiny_checkpoint),
           "PERSONAPLEX_INJECT_FAULTS": ",".join(f"{kind}:{key}" for kind, key in FAULTS.items())}
    with TritonServer(repository, env=env, log_path=root / "tritonserver.log") as srv:
        srv.stub_models = stub_models
        yield srv


def user_pcm(frames: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.3, 0.3, frames * contract.FRAME_SAMPLES).astype(np.float32)


@pytest.fixture(scope="module")
def healthy_alone(faulty):
    """The healthy conversation alone; run twice, so its persona is cached from then on."""
    stream_conversation(user_pcm(2), url=faulty.grpc_url, persona=HEALTHY)
    return stream_conversation(user_pcm(24), url=faulty.grpc_url, persona=HEALTHY)


class Beside:
    """The healthy conversation in a thread, while the test does something else."""

    def __init__(self, server):
        self.result = None
        self._thread = threading.Thread(target=self._talk, args=(server,))
        self._thread.start()

    def _talk(self, server):
        self.result = stream_conversation(user_pcm(24), url=server.grpc_url, persona=HEALTHY)

    def assert_lost_nothing(self, alone):
        self._thread.join(300)
        assert self.result is not None, "the healthy conversation failed"
        assert self.result.frames_received == alone.frames_received == 24
        assert self.result.text_pieces == alone.text_pieces
        np.testing.assert_allclose(self.result.audio, alone.audio, atol=1e-4)


def test_malformed_and_over_limit_requests_get_clear_errors(faulty, healthy_alone):
    beside = Beside(faulty)
    start = [voice_input("NATF0")]
    cases = [  # (AUDIO_IN, extra inputs, start, end, what the error must say)
        (None, start, True, True, "missing input AUDIO_IN"),
        (FRAME, [tensor(contract.TEXT_PROMPT, np.array([b"a" * 200_000]))], True, True,
         "TEXT_PROMPT has 200000 characters; the limit is 4000"),
        (FRAME, [tensor(contract.TEXT_PROMPT, np.array([b"hello there " * 300]))], True, True,
         "tokens long; the limit is 256"),
        (np.zeros((tunables.MAX_FRAMES_PER_REQUEST + 1) * contract.FRAME_SAMPLES, np.float32), start, True, True,
         "holds 126 frames; the limit is 125 per request"),
        (FRAME, [tensor(contract.TOP_K, np.array([501], np.int32))], True, True, r"TOP_K must lie in [1, 500]"),
        (FRAME, [tensor(contract.TOP_K_TEXT, np.array([0], np.int32))], True, True, "TOP_K_TEXT must lie in [1, 500]"),
        (FRAME, [tensor(contract.TEMPERATURE, np.array([np.nan], np.float32))], True, True,
         "TEMPERATURE must be a finite number, got nan"),
        (FRAME, [tensor(contract.TEMPERATURE_TEXT, np.array([0.0], np.float32))], True, True,
         "TEMPERATURE_TEXT must lie in (0, 10]"),
        (np.full(1920, 2.0, np.float32), start, True, True, "must lie in [-1, 1]"),
        (FRAME, [voice_input("NOBODY")], True, True, "unknown voice 'NOBODY'"),
    ]
    for sequence_id, (audio, extra, first, last, message) in enumerate(cases, start=801):
        responses, error = raw_request(faulty, audio, sequence_id, first, last, extra)
        assert responses == [] and error is not None and message in error, (sequence_id, error)
    # Mid-conversation: only SEED (the ensemble wants AUDIO_IN), SEED with audio (persona inputs
    # only at the start); the conversation carries on after both.
    assert raw_request(faulty, FRAME, 830, True, False, start)[1] is None
    _, error = raw_request(faulty, None, 830, False, False, [tensor(contract.SEED, np.array([3], np.int64))])
    assert "missing input AUDIO_IN" in error
    _, error = raw_request(faulty, FRAME, 830, False, False, [tensor(contract.SEED, np.array([3], np.int64))])
    assert "only accepted on the sequence-start request" in error
    responses, error = raw_request(faulty, FRAME, 830, False, True)
    assert error is None and len(responses) == 1
    beside.assert_lost_nothing(healthy_alone)
    # No refused start holds a slot of the talker or code2wav.
    assert wait_for(lambda: active(faulty) == 0 and active(faulty, "code2wav") == 0, 30)


def test_internal_faults_stay_with_their_conversation(faulty, healthy_alone):
    beside = Beside(faulty)
    with pytest.raises(ServerError, match="injected fault in conversation 7001"):
        stream_conversation(user_pcm(4), url=faulty.grpc_url, sequence_id=FAULTS["tick"])
    # A step failing once, naming no one, is retried: nobody loses a frame.
    flaky = stream_conversation(user_pcm(4), url=faulty.grpc_url, sequence_id=FAULTS["flaky-tick"])
    assert flaky.frames_received == 4
    with pytest.raises(ServerError, match="could not send a response: injected send fault"):
        stream_conversation(user_pcm(4), url=faulty.grpc_url, sequence_id=FAULTS["send"])
    beside.assert_lost_nothing(healthy_alone)
    assert wait_for(lambda: active(faulty) == 0, 30)


def test_vanished_client_frees_its_slot(faulty):
    client = grpcclient.InferenceServerClient(faulty.grpc_url)
    answered = threading.Event()
    client.start_stream(lambda result, error: answered.set())
    client.async_stream_infer(contract.MODEL_NAME, [tensor(contract.AUDIO_IN, FRAME), voice_input("NATM0")],
                              sequence_id=901, sequence_start=True, sequence_end=False)
    assert answered.wait(120)
    client.stop_stream(cancel_requests=True)  # gone without the end request
    client.close()
    vanished = time.monotonic()
    # Through the ensemble Triton 2.51 does not pass the cancellation on: the idle timeout frees it.
    assert wait_for(lambda: active(faulty) == 0, IDLE_TIMEOUT_S + 20)
    assert time.monotonic() - vanished >= IDLE_TIMEOUT_S - 1
    _, error = raw_request(faulty, FRAME, 901, False, True)
    assert "conversation 901 is not open" in error and "idle too long" in error


def test_metrics_on_the_prometheus_endpoint(faulty):
    # counters reach the endpoint in batches of up to half a second: the last test's not_open shows after it
    not_open = 'personaplex_requests_rejected_total{model="talker",reason="not_open"}'
    assert wait_for(lambda: not_open in scrape(faulty.metrics_url), 5)
    samples = scrape(faulty.metrics_url)
    one_tick = "one tick steps the talker and decodes its frames" in faulty.log_path.read_text()
    assert one_tick == (faulty.stub_models == ("speech",))  # the one-stub repository's default
    for model in ("talker", "code2wav"):
        label = f'{{model="{model}"}}'
        assert samples[f"personaplex_frames_total{label}"] > 0
        # in one tick, code2wav has no ticks of its own: they are the talker's
        assert (samples.get(f"personaplex_tick_duration_seconds_count{label}", 0) > 0) == (model == "talker" or not one_tick)
        assert samples[f"personaplex_frame_latency_seconds_count{label}"] >= samples[f"personaplex_frames_total{label}"]
        assert samples[f"personaplex_engine_up{label}"] == 1
        assert abs(samples[f"personaplex_engine_heartbeat_seconds{label}"] - time.time()) < 15
        assert 0 <= samples[f"personaplex_sends_behind_seconds{label}"] < 0.25  # idle: nothing waits to be sent
        assert f"personaplex_conversations_prefilling{label}" in samples
        collections = {series_labels(series)["generation"]: value for series, value in samples.items()
                       if series.startswith("personaplex_gc_pause_seconds_count{")
                       and series_labels(series)["model"] == model}
        assert collections.get("0", 0) > 0, collections  # the stub's young collections, timed
    # what each stub loaded is frozen out of the collector's walks: hundreds of thousands of objects
    frozen = [int(n) for n in re.findall(r"loaded; (\d+) objects frozen", faulty.log_path.read_text())]
    assert len(frozen) == len(faulty.stub_models) and min(frozen) > 100_000, frozen
    rejected = lambda reason: samples.get(f'personaplex_requests_rejected_total{{model="talker",reason="{reason}"}}', 0)
    assert rejected("limit") >= 3 and rejected("invalid_input") >= 7 and rejected("internal") >= 2
    assert rejected("not_open") >= 1
    assert samples['personaplex_persona_cache_lookups_total{model="talker",result="hit"}'] >= 1
    assert samples['personaplex_persona_cache_lookups_total{model="talker",result="miss"}'] >= 1
    # the histograms' counters add up: the +Inf bucket holds every observation, each bucket at
    # least the one below it, and none is over 10.24 s
    for name in ("personaplex_tick_duration_seconds", "personaplex_frame_latency_seconds"):
        buckets = sorted((float(labels["le"]), value) for series, value in samples.items()
                         if series.startswith(name + "_bucket{") and (labels := series_labels(series))["model"] == "talker")
        count = samples[f'{name}_count{{model="talker"}}']
        assert buckets[-1] == (float("inf"), count) and buckets[-2] == (10.24, count)
        assert all(low[1] <= high[1] for low, high in zip(buckets, buckets[1:]))
        assert samples[f'{name}_sum{{model="talker"}}'] > 0


def test_killed_stub_turns_the_health_check_false(faulty):
    """Last in this module: it leaves the server's talker dead."""
    assert health.problems(faulty.http_url, faulty.metrics_url) == []
    cli = subprocess.run([sys.executable, "-m", "personaplex_triton.serving.health",
                          "--url", faulty.http_url, "--metrics-url", faulty.metrics_url],
                         capture_output=True, text=True, timeout=60)
    pids = faulty.stub_pids(faulty.stub_models[0])
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    # code2wav dies with the talker only where both run in the one stub; each heartbeat ages on its own
    dead = ("talker",) if "code2wav" in faulty.stub_models else ("talker", "code2wav")
    stages_found = lambda: {p.split(":")[0] for p in health.problems(faulty.http_url, faulty.metrics_url)}
    assert wait_for(lambda: stages_found() >= set(dead), 20), stages_found()
    assert ("code2wav" in stages_found()) == ("code2wav" in dead)
    assert cli.returncode == 0 and cli.stdout.strip() == "ok"


class Stream:
    """One client's gRPC stream, kept open: what each request got, and any error on the stream."""

    def __init__(self, server):
        self.frames, self.finals, self.errors = [], [], []
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.client.start_stream(self._callback)

    def _callback(self, result, error):
        if error is not None:
            self.errors.append(str(error))
            return
        if result.get_response().outputs:
            self.frames.append(1)
        if is_final_response(result):
            self.finals.append(1)

    def send(self, sequence_id, frames, start=False):
        self.client.async_stream_infer(contract.MODEL_NAME, [tensor(contract.AUDIO_IN, user_pcm(frames))],
                                       sequence_id=sequence_id, sequence_start=start,
                                       enable_empty_final_response=True)

    def close(self):
        try:
            self.client.stop_stream()
        finally:
            self.client.close()


@pytest.mark.parametrize("repository", REPOSITORIES)
def test_sigterm_drains_then_exits_cleanly_with_conversations_open(repository, tiny_checkpoint, tmp_path):
    """SIGTERM to the launcher with a conversation mid-request and one idle but connected: the
    pending request is answered in full; a new conversation and a new request are refused with
    an error naming the shutdown; the idle client's stream is closed, not left silent; the
    launcher exits 0 within its bound, with no stub process or shared memory left behind."""
    from personaplex_triton.serving.launch import SHUTDOWN_BOUND_S

    log = tmp_path / "triton.log"
    home, stub_models = REPOSITORIES[repository]
    server = TritonServer(home, env={"PERSONAPLEX_CHECKPOINT": str(tiny_checkpoint)}, log_path=log)
    with server:
        idle, talking = Stream(server), Stream(server)
        try:
            for stream, key in ((idle, 61), (talking, 62)):
                stream.send(key, 1, start=True)
                assert wait_for(lambda: stream.finals, 120) and not stream.errors
            pending = 40
            talking.send(62, pending)
            assert wait_for(lambda: len(talking.frames) > 1, 120)
            tritonserver, stubs = server.tritonserver_pid(), server.stub_pids()
            shared_memory = [Path("/dev/shm") / child_processes(tritonserver)[pid][2] for pid in stubs]
            assert len(stubs) == len(stub_models) and all(p.exists() for p in shared_memory)
            signalled = time.monotonic()
            server.process.send_signal(signal.SIGTERM)

            key, refused = 70, None  # answered until the talker's drain begins, refused from then on
            while refused is None and time.monotonic() - signalled < 15:
                key += 1
                refused = raw_request(server, FRAME, key, True, False)[1]
            assert refused is not None and "the server is shutting down; no new conversations" in refused
            talking.send(62, 1)  # the 40 frames are still being answered
            assert wait_for(lambda: talking.errors, 30), "the new request was not answered"
            assert "the server is shutting down; no new requests" in talking.errors[0]

            status = server.process.wait(SHUTDOWN_BOUND_S + 5)
            took = time.monotonic() - signalled
            assert status == 0 and took < SHUTDOWN_BOUND_S, (status, took)
            assert len(talking.frames) == 1 + pending and len(talking.finals) == 2  # start, pending: in full
            assert wait_for(lambda: idle.errors, 10), "the idle client's stream was left open and silent"
            assert "UNAVAILABLE" in idle.errors[0], idle.errors
            assert not child_processes(server.process.pid) and not any(Path(f"/proc/{p}").exists() for p in stubs)
            assert not any(p.exists() for p in shared_memory), "a stub did not exit cleanly"
            text = log.read_text(errors="replace")
            assert all(f"successfully unloaded '{model}'" in text for model in stub_models)
            assert "Exiting immediately" not in text
        finally:
            idle.close()
            talking.close()
