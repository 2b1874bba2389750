"""PersonaPlex's own web client (NVIDIA/personaplex `client/`, built with `npm ci && npx vite
build`), served by the gateway's `--static`, in Debian's headless Chromium with a fake microphone
playing samples/user.wav, against a real tritonserver: it connects to /api/chat unchanged, and
the agent's audio plays and its text shows.

It needs that client's built files, which this repository does not hold: name their folder in
PERSONAPLEX_WEB_CLIENT_DIST (docs/gateway.md says how to build them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

DIST = os.environ.get("PERSONAPLEX_WEB_CLIENT_DIST")
CHROMIUM = "/usr/bin/chromium"
REPO_ROOT = Path(__file__).resolve().parents[1]
TALK_S = 12

if not DIST or not (Path(DIST) / "index.html").is_file():
    pytest.skip("PersonaPlex's built web client is absent: PERSONAPLEX_WEB_CLIENT_DIST names no folder with "
                "an index.html", allow_module_level=True)
if not Path(CHROMIUM).is_file():
    pytest.skip(f"{CHROMIUM} is absent: Debian's chromium package is not installed (make browser-deps)",
                allow_module_level=True)

from playwright.sync_api import sync_playwright  # noqa: E402  (after the skips: the test extra has it)

from personaplex_gateway.readiness import wait_answering  # noqa: E402
from personaplex_triton.serving.launch import free_port  # noqa: E402

BROWSER_ARGS = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                f"--use-file-for-fake-audio-capture={REPO_ROOT / 'samples' / 'user.wav'}",
                "--autoplay-policy=no-user-gesture-required", "--disable-gpu", "--no-first-run"] + (
    ["--no-sandbox"] if os.geteuid() == 0 else [])


def test_personaplex_web_client_talks_through_the_gateway_unchanged(server, tiny_checkpoint):
    port = free_port()
    gateway = subprocess.Popen([sys.executable, "-m", "personaplex_gateway", "--triton-url", server.grpc_url,
                                "--port", str(port), "--static", DIST, "--checkpoint", str(tiny_checkpoint)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://localhost:{port}"  # the client opens its socket on the page's own host and port
    received, errors = [], []
    try:
        wait_answering(base, gateway, 60)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=BROWSER_ARGS)
            page = browser.new_page()

            def on_socket(ws):
                ws.on("framereceived", lambda payload: received.append(payload[:1]) if isinstance(payload, bytes) else None)
                ws.on("framereceived", lambda payload: errors.append(payload[1:].decode()) if isinstance(payload, bytes)
                      and payload[:1] == b"\x05" else None)

            page.on("websocket", on_socket)
            page.goto(base + "/")
            page.select_option("#voice-prompt", "NATF0.pt")  # a voice of the generated checkpoint
            page.get_by_text("Connect").click()
            page.get_by_text("Audio played:").wait_for(timeout=120_000)  # shown once the handshake came
            time.sleep(TALK_S)
            played = page.locator("td", has_text=re.compile(r"^\d+:\d\d\.\d\d$")).first.inner_text()
            browser.close()
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
    assert not errors, errors
    assert received[0] == b"\x00"  # the handshake first
    assert received.count(b"\x01") >= TALK_S * 5 and b"\x02" in received  # Ogg pages and text pieces
    minutes, seconds = played.split(":")
    assert 60 * int(minutes) + float(seconds) >= TALK_S - 4, f"the client played {played} of agent audio"
