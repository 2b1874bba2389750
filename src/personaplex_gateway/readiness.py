"""Waiting for a gateway started as a process of its own (`make web`'s launcher, the tests, the
benchmark): until its /healthz answers."""

from __future__ import annotations

import ssl
import subprocess
import time
import urllib.error
import urllib.request

POLL_S = 0.25


def wait_answering(url: str, process: subprocess.Popen, timeout_s: float, ready: bool = True,
                   context: ssl.SSLContext | None = None) -> None:
    """Until the gateway at `url` answers /healthz: with 200 (Triton ready behind it) if `ready`,
    else with any status. RuntimeError if `process` exits first, TimeoutError after `timeout_s`.
    `context`: the TLS context of an https `url`."""
    health = url.rstrip("/") + "/healthz"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the gateway exited with code {process.returncode} before it answered")
        try:
            with urllib.request.urlopen(health, timeout=2, context=context):
                return
        except urllib.error.HTTPError:  # it answers, Triton behind it not ready (503)
            if not ready:
                return
        except OSError:
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"the gateway at {url} did not answer{' as ready' if ready else ''} after {timeout_s:.0f} s")
