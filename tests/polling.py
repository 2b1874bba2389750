"""Waiting in tests for what another thread or process makes true."""

from __future__ import annotations

import time


def wait_for(condition, timeout_s: float = 10.0, every_s: float = 0.25) -> bool:
    """Whether `condition()` came true within `timeout_s`, asked every `every_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every_s)
    return False
