"""The gateway's page at / in a real browser: Debian's Chromium, headless, driven by Playwright,
with a fake microphone that plays samples/user.wav (looped), against the real gateway in front
of a real tritonserver on the generated checkpoint.

The page mirrors what it shows on `window.personaplex` (state, frames sent / answered /
played, the peak of what reached the speakers, transcript, latency), which the tests read.

PERSONAPLEX_PAGE_SCREENSHOT=docs/gateway-page.png writes a screenshot of the page in the
middle of the conversation (the one in docs/ is made so).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import urllib.error
import urllib.request
import wave
from pathlib import Path

import numpy as np
import pytest
from playwright.sync_api import sync_playwright

from personaplex_gateway.readiness import wait_answering
from personaplex_triton.serving.launch import free_port

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[1]
SPEECH_WAV = REPO_ROOT / "samples" / "user.wav"
CHROMIUM = "/usr/bin/chromium"  # Debian's package (make browser-deps); Playwright's own download is not used
SCREENSHOT_ENV = "PERSONAPLEX_PAGE_SCREENSHOT"
FRAMES_PER_S = 12.5  # 1920-sample frames at 24 kHz
TALK_S = 12  # at least 10 s of conversation
# A 2-core CI machine runs tritonserver, the gateway and Chromium at once: generous bounds.
READY_TIMEOUT_MS = 60_000
LIVE_TIMEOUT_MS = 120_000  # the persona's prefill (the page's default role prompt is not prefilled at load)
ANSWERS_TIMEOUT_MS = (TALK_S + 90) * 1000
GATEWAY_READY_S = 60

if not Path(CHROMIUM).is_file():
    pytest.skip(f"{CHROMIUM} is absent: Debian's chromium package is not installed (make browser-deps)",
                allow_module_level=True)

BROWSER_ARGS = [
    "--use-fake-ui-for-media-stream",  # grants the microphone without a prompt
    "--use-fake-device-for-media-stream",
    f"--use-file-for-fake-audio-capture={SPEECH_WAV}",
    "--autoplay-policy=no-user-gesture-required",
    "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--no-first-run",
] + (["--no-sandbox"] if os.geteuid() == 0 else [])  # Chromium's sandbox refuses to run as root

# Makes the page's AudioContext refuse 24 kHz, as some browsers do: it then runs at the
# browser's own rate and the worklets resample.
REFUSE_24KHZ = """{
  const Native = window.AudioContext;
  window.AudioContext = class extends Native {
    constructor(options = {}) {
      if (options.sampleRate) throw new DOMException("sample rate refused", "NotSupportedError");
      super(options);
    }
  };
}"""


@contextlib.contextmanager
def running_gateway(triton_url: str, checkpoint: Path, log: Path, *flags: str, ready: bool = True):
    """The real gateway (its console entry point) in front of `triton_url`, on a free port:
    yields its base URL once it answers (with Triton ready behind it, if `ready`)."""
    port = free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "personaplex_gateway", f"--triton-url={triton_url}", f"--port={port}",
             f"--checkpoint={checkpoint}", *flags], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_answering(url, process, GATEWAY_READY_S, ready)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def gateway(server, tiny_checkpoint, tmp_path_factory):
    with running_gateway(server.grpc_url, tiny_checkpoint, tmp_path_factory.mktemp("gateway") / "gateway.log") as url:
        yield url


GATEWAY_TOKEN = "page-test-token"


@pytest.fixture(scope="module")
def gateway_with_token(server, tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with running_gateway(server.grpc_url, tiny_checkpoint, log, f"--token={GATEWAY_TOKEN}") as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=BROWSER_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 760}, accept_downloads=True)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, f"the page raised: {errors}"


def open_ready(page, url: str) -> dict:
    page.goto(url)
    page.wait_for_function("window.personaplex && window.personaplex.state === 'ready'", timeout=READY_TIMEOUT_MS)
    return page.evaluate("window.personaplex")


def state(page) -> dict:
    return page.evaluate("window.personaplex")


def test_a_conversation_in_the_page(page, gateway):
    ready = open_ready(page, gateway)
    with urllib.request.urlopen(gateway + "api/voices") as reply:
        offered = json.load(reply)
    assert ready["voices"] == offered["voices"] and offered["voices"]
    assert page.input_value("#voice") == offered["default_voice"]
    assert page.input_value("#prompt") == offered["default_prompt"]

    page.click("#start")
    page.wait_for_function("window.personaplex.state === 'live'", timeout=LIVE_TIMEOUT_MS)
    assert page.text_content("#status-text") == "Live"
    assert page.text_content("#stop") == "End conversation" and not page.is_visible("#start")
    # Talks for TALK_S, and has TALK_S - 2 s of answers: on a loaded machine they come late, not never.
    page.wait_for_function(f"window.personaplex.framesSent >= {TALK_S * FRAMES_PER_S} && "
                           f"window.personaplex.framesReceived >= {(TALK_S - 2) * FRAMES_PER_S}",
                           timeout=ANSWERS_TIMEOUT_MS)
    # What arrived goes through the jitter buffer to the speakers (played, or dropped past its
    # bound): all but what it holds (at most 600 ms) and the player's last report (100 ms) miss.
    page.wait_for_function("window.personaplex.framesPlayed + window.personaplex.framesDropped >= "
                           "window.personaplex.framesReceived - 10", timeout=30_000)
    if os.environ.get(SCREENSHOT_ENV):
        page.screenshot(path=os.environ[SCREENSHOT_ENV])
    page.click("#stop")
    page.wait_for_function("window.personaplex.state === 'ended'")
    ended = state(page)

    assert ended["elapsedS"] >= TALK_S - 1  # by the page's clock; the fake microphone's runs on its own
    # The agent's (random-weight) audio was played, far from silence.
    assert ended["framesPlayed"] >= TALK_S / 2 * FRAMES_PER_S
    assert ended["peak"] > 0.01, f"the agent's audio reached the speakers silent (peak {ended['peak']})"
    assert ended["samplesPlayed"] >= ended["framesPlayed"] * 1920
    # The generated checkpoint's text pieces (random tokens, as the demo prints them) appear.
    assert ended["transcript"].strip(), "no agent text reached the page"
    assert page.text_content("#transcript").strip() == ended["transcript"].strip()
    assert ended["latencyMedianMs"] > 0
    # the readout and the state it shows, read at one moment (a late answer may still move them)
    median, shown = page.evaluate("[window.personaplex.latencyMedianMs, document.getElementById('latency').textContent]")
    assert shown == f"{math.floor(median + 0.5)} ms"  # JavaScript's Math.round: 54.5 -> 55 (Python's round: 54)

    # The recording: stereo 24 kHz, the user (the fake microphone's speech) left, the agent right.
    with page.expect_download() as download:
        page.click("#download-audio")
    with wave.open(io.BytesIO(Path(download.value.path()).read_bytes())) as wav:
        assert (wav.getnchannels(), wav.getframerate(), wav.getsampwidth()) == (2, 24000, 2)
        assert wav.getnframes() == max(ended["framesSent"], ended["framesReceived"]) * 1920
        samples = np.frombuffer(wav.readframes(wav.getnframes()), np.int16).reshape(-1, 2)
    user, agent = samples[:, 0], samples[:, 1]
    assert np.abs(user).max() > 1000 and np.abs(agent).max() > 300
    with page.expect_download() as download:
        page.click("#download-text")
    assert ended["transcript"].strip() in Path(download.value.path()).read_text()


def test_while_triton_is_not_ready_the_page_waits(page, tiny_checkpoint, tmp_path):
    """A gateway whose Triton is not up (nothing listens on its port): its voices are offered,
    the status says the server is starting, and a conversation cannot start."""
    log = tmp_path / "gateway.log"
    # The cap given: the gateway would otherwise ask the absent Triton for its slots.
    with running_gateway(f"localhost:{free_port()}", tiny_checkpoint, log, "--max-connections=1", ready=False) as url:
        page.goto(url)
        page.wait_for_function("window.personaplex.state === 'starting'", timeout=READY_TIMEOUT_MS)
        assert page.text_content("#status-text") == "Server starting…"
        assert page.evaluate("window.personaplex.voices") and page.is_enabled("#voice")
        assert not page.is_enabled("#start") and not page.is_visible("#error")


def test_an_unknown_voice_shows_the_servers_message(page, gateway):
    open_ready(page, gateway)
    page.evaluate("""() => {
        const select = document.getElementById("voice");
        select.append(new Option("NOPE9", "NOPE9"));
        select.value = "NOPE9";
    }""")
    page.click("#start")
    page.wait_for_function("window.personaplex.state === 'error'", timeout=LIVE_TIMEOUT_MS)
    message = state(page)["error"]
    assert "NOPE9" in message and "unknown_voice" in message
    assert page.is_visible("#error") and page.text_content("#error-text") == message
    assert page.is_visible("#start") and page.is_enabled("#start") and not page.is_visible("#stop")


# Holds getUserMedia's answer for a second (a person reading the browser's prompt) and keeps
# the streams it gave, to see whether the page let go of the microphone.
SLOW_MICROPHONE = """{
  window.streamsGiven = [];
  const native = navigator.mediaDevices.getUserMedia.bind(navigator.mediaDevices);
  navigator.mediaDevices.getUserMedia = async (constraints) => {
    await new Promise((resolve) => setTimeout(resolve, 1000));
    const stream = await native(constraints);
    window.streamsGiven.push(stream);
    return stream;
  };
}"""


def test_cancel_while_the_microphone_is_asked_for(page, gateway):
    page.add_init_script(SLOW_MICROPHONE)
    open_ready(page, gateway)
    page.click("#start")
    assert state(page)["state"] == "connecting" and page.text_content("#stop") == "Cancel"
    page.click("#stop")
    page.wait_for_function("window.streamsGiven.length === 1", timeout=30_000)
    page.wait_for_timeout(500)
    assert state(page)["state"] == "ended" and state(page)["framesSent"] == 0
    assert page.evaluate("window.streamsGiven[0].getTracks().map((track) => track.readyState)") == ["ended"]
    assert page.is_visible("#start") and not page.is_visible("#stop")


def test_the_pages_token_reaches_the_socket(page, gateway_with_token):
    """Without a token the gateway refuses the socket at its upgrade, and the page shows its
    reason; with the page's own ?token= the conversation starts."""
    open_ready(page, gateway_with_token)
    page.click("#start")
    page.wait_for_function("window.personaplex.state === 'error'", timeout=LIVE_TIMEOUT_MS)
    assert "needs a token" in page.text_content("#error-text")
    open_ready(page, f"{gateway_with_token}?token={GATEWAY_TOKEN}")
    assert not page.is_visible("#error")
    page.click("#start")
    page.wait_for_function("window.personaplex.state === 'live'", timeout=LIVE_TIMEOUT_MS)


def test_a_browser_that_refuses_24khz_resamples(page, gateway):
    page.add_init_script(REFUSE_24KHZ)
    open_ready(page, gateway)
    page.click("#start")
    page.wait_for_function("window.personaplex.state === 'live'", timeout=LIVE_TIMEOUT_MS)
    page.wait_for_function("window.personaplex.elapsedS >= 5", timeout=60_000)
    page.click("#stop")
    ended = state(page)
    assert ended["contextRate"] != 24000
    # Frames of 1920 samples at 24 kHz leave at 12.5 a second only if the capture resampled.
    assert ended["framesSent"] == pytest.approx(ended["elapsedS"] * FRAMES_PER_S, rel=0.15)
    assert ended["framesPlayed"] > 0 and ended["peak"] > 0.01
    # Played at the context's rate: each 24 kHz frame became 1920 * rate / 24000 samples.
    assert ended["samplesPlayed"] >= ended["framesPlayed"] * 1920 * ended["contextRate"] / 24000 * 0.95


@pytest.mark.parametrize("rate", [44100, 48000])
def test_the_capture_resampler(page, gateway, rate):
    """The capture worklet, offline at `rate`: a 1 kHz tone keeps its level and its frequency at
    24 kHz, and a 15 kHz one, above 24 kHz's Nyquist, is filtered out, not folded to 9 kHz."""
    page.goto(gateway)
    measured = page.evaluate("""async (rate) => {
        const tone = async (hz) => {
            const context = new OfflineAudioContext(1, rate, rate);  // 1 s
            await context.audioWorklet.addModule("audio-processors.js");
            const capture = new AudioWorkletNode(context, "capture-processor", { numberOfOutputs: 0 });
            const frames = [];
            capture.port.onmessage = (event) => frames.push(event.data);
            const oscillator = new OscillatorNode(context, { frequency: hz });
            const gain = new GainNode(context, { gain: 0.5 });
            oscillator.connect(gain).connect(capture);
            oscillator.start();
            await context.startRendering();
            await new Promise((resolve) => setTimeout(resolve, 200));  // the last frames' messages
            const steady = frames.slice(1).flatMap((frame) => Array.from(frame));  // past the filter's start
            const rms = Math.sqrt(steady.reduce((sum, s) => sum + s * s, 0) / steady.length);
            let crossings = 0;
            for (let i = 1; i < steady.length; i++) if ((steady[i - 1] < 0) !== (steady[i] < 0)) crossings++;
            return { frames: frames.length, rms, hz: crossings / 2 / (steady.length / 24000) };
        };
        return { low: await tone(1000), high: await tone(15000) };
    }""", rate)
    assert measured["low"]["frames"] == 12  # 1 s at 24 kHz: 12 whole frames of 1920
    assert measured["low"]["rms"] == pytest.approx(0.5 / np.sqrt(2), rel=0.02)
    assert measured["low"]["hz"] == pytest.approx(1000, rel=0.01)
    assert measured["high"]["rms"] < 0.01


def test_the_jitter_buffer_bounds_its_delay(page, gateway):
    """The playback worklet, offline at 24 kHz, given 25 frames (2 s) at once: each time a frame
    takes the queue past its 600 ms bound (the 8th, 14th, 20th), the oldest go, down to its
    160 ms target (2 frames left), so 18 are dropped and the newest 7 play whole; then it runs
    dry once and plays silence."""
    page.goto(gateway)
    played = page.evaluate("""async () => {
        const context = new OfflineAudioContext(1, 24000, 24000);  // 1 s
        await context.audioWorklet.addModule("audio-processors.js");
        const player = new AudioWorkletNode(context, "playback-processor", {
            numberOfInputs: 0, outputChannelCount: [1], processorOptions: { targetMs: 160, maxMs: 600 } });
        const reports = [];
        player.port.onmessage = (event) => reports.push(event.data);
        player.connect(context.destination);
        for (let f = 0; f < 25; f++) player.port.postMessage(new Float32Array(1920).fill(f % 2 ? 0.5 : -0.5));
        await new Promise((resolve) => setTimeout(resolve, 200));  // the frames reach the worklet first
        const rendered = (await context.startRendering()).getChannelData(0);
        await new Promise((resolve) => setTimeout(resolve, 200));
        let audible = 0;
        for (const s of rendered) if (s !== 0) audible++;
        return { ...reports[reports.length - 1], audible, last: rendered[7 * 1920 - 1] };
    }""")
    assert (played["framesDropped"], played["framesPlayed"], played["underruns"]) == (18, 7, 1)
    assert played["audible"] == 7 * 1920 and played["peak"] == 0.5
    assert played["last"] == -0.5  # the last sample played is the newest frame's (frame 24: -0.5)


def test_the_jitter_buffer_trims_a_standing_delay(page, gateway):
    """The playback worklet, offline at 24 kHz: 6 frames (480 ms) at once, under its 600 ms
    bound, then one frame every 80 ms of playback, so 400 to 480 ms stay queued. After 2 s
    above target + a frame (240 ms) it drops the oldest back to its 160 ms target, once, and
    plays on without a gap."""
    page.goto(gateway)
    played = page.evaluate("""async () => {
        const context = new OfflineAudioContext(1, 4 * 24000, 24000);  // 4 s
        await context.audioWorklet.addModule("audio-processors.js");
        const player = new AudioWorkletNode(context, "playback-processor", {
            numberOfInputs: 0, outputChannelCount: [1],
            processorOptions: { targetMs: 160, maxMs: 600, trimAfterMs: 2000 } });
        const reports = [];
        player.port.onmessage = (event) => reports.push(event.data);
        player.connect(context.destination);
        const settle = () => new Promise((resolve) => setTimeout(resolve, 30));  // a message reaches the worklet
        const frame = () => new Float32Array(1920).fill(0.25);
        for (let f = 0; f < 6; f++) player.port.postMessage(frame());
        await settle();
        for (let k = 1; k < 50; k++) {  // rendering stops at each 80 ms for the next frame to arrive
            context.suspend(k * 0.08).then(async () => {
                player.port.postMessage(frame());
                await settle();
                context.resume();
            });
        }
        const rendered = (await context.startRendering()).getChannelData(0);
        await settle();
        await settle();
        const firstSilent = rendered.findIndex((sample) => sample === 0);
        return { ...reports[reports.length - 1], firstSilent };
    }""")
    assert played["framesDropped"] == 3  # at 2 s, before the 25th frame arrives: 400 ms, back to 160
    assert played["underruns"] == 0 and played["firstSilent"] == -1
    assert played["queuedMs"] <= 240
