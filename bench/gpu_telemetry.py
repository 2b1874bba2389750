"""The GPU's clocks, power and temperatures along a run, from nvidia-smi once a second.

A long run's latency can drift because the card slows (power or thermal limits) rather than
because the server does; with these per window beside the ticks, the two can be told apart.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import numpy as np

# nvidia-smi's field: our name. Newer drivers call the last one clocks_event_reasons.active and keep
# the old name as an alias; where neither is known, it is left out.
FIELDS = {"clocks.sm": "sm_mhz", "clocks.mem": "mem_mhz", "power.draw": "power_w",
          "temperature.gpu": "gpu_c", "temperature.memory": "memory_c", "utilization.gpu": "utilization"}
REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def query_fields() -> list[str] | None:
    """The fields this machine's nvidia-smi answers (the limit reasons under whichever name it
    knows), or None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    for reasons in (*REASONS, None):
        fields = [*FIELDS, *([reasons] if reasons else [])]
        if subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                          capture_output=True).returncode == 0:
            return fields
    return None


def parse(line: str, fields: list[str], at: float) -> dict:
    """One line of nvidia-smi's csv (noheader, nounits) for the first GPU: {our name: value}, at
    `at`; a value it does not know ("[N/A]") is None, the limit reasons an int bitmask."""
    sample = {"t": at}
    for field, text in zip(fields, (v.strip() for v in line.split(","))):
        if field in REASONS:
            sample["reasons"] = int(text, 16) if text.startswith("0x") else None
            continue
        try:
            sample[FIELDS[field]] = float(text)
        except ValueError:
            sample[FIELDS[field]] = None
    return sample


def window_figures(samples: list[dict], start: float, end: float) -> dict | None:
    """Over the samples taken in [start, end): the median of each figure, the SM clock's lowest,
    and the limit reasons seen (their bits or'd, hex); None without samples there."""
    inside = [s for s in samples if start <= s["t"] < end]
    if not inside:
        return None
    found = {"samples": len(inside)}
    for name in FIELDS.values():
        values = [s[name] for s in inside if s.get(name) is not None]
        found[name] = round(float(np.median(values)), 1) if values else None
    clocks = [s["sm_mhz"] for s in inside if s.get("sm_mhz") is not None]
    found["sm_mhz_min"] = min(clocks) if clocks else None
    reasons = [s["reasons"] for s in inside if s.get("reasons") is not None]
    found["reasons"] = hex(int(np.bitwise_or.reduce(reasons))) if reasons else None
    return found


class GpuTelemetry:
    """nvidia-smi sampling the first GPU every `interval_s` while in the `with` block; `samples`
    then holds what it read. Without nvidia-smi it samples nothing."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self._process = None
        self._reader = None

    def __enter__(self) -> GpuTelemetry:
        fields = query_fields()
        if fields is None:
            return self
        self._process = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "-i", "0",
             f"--loop-ms={int(self.interval_s * 1000)}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, args=(fields,), daemon=True)
        self._reader.start()
        return self

    def _read(self, fields: list[str]) -> None:
        for line in self._process.stdout:
            if line.strip():
                self.samples.append(parse(line, fields, time.time()))

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(10)
            self._reader.join(5)
