"""Is the server fit for traffic? A check for load balancers, beyond Triton's own readiness.

Triton 2.51 keeps reporting a Python model READY after its stub process died or its engine
stopped, so this check also reads the stages' own metrics: each model's engine must be up
(`personaplex_engine_up` 1) and its loop must have passed recently
(`personaplex_engine_heartbeat_seconds`, set at least once a second; compared with this
machine's clock, so run the check where the server runs, or with synchronised clocks).

    python -m personaplex_triton.serving.health [--url localhost:8000] [--metrics-url localhost:8002]

prints `ok` and exits 0, or prints each problem and exits 1.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import urllib.error
import urllib.request

MODELS = ("talker", "code2wav")
MAX_HEARTBEAT_AGE_S = 5.0
_SAMPLE = re.compile(r'^(personaplex_engine_(?:up|heartbeat_seconds))\{model="([^"]+)"\} (\S+)$')


def engine_samples(metrics_text: str) -> dict[tuple[str, str], float]:
    """(metric, model) -> value of the engines' health metrics in a Prometheus scrape."""
    samples = {}
    for line in metrics_text.splitlines():
        found = _SAMPLE.match(line)
        if found:
            samples[(found.group(1), found.group(2))] = float(found.group(3))
    return samples


def _get(url: str, timeout_s: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def problems(url: str = "localhost:8000", metrics_url: str = "localhost:8002", models=MODELS,
             max_heartbeat_age_s: float = MAX_HEARTBEAT_AGE_S, timeout_s: float = 2.0) -> list[str]:
    """What keeps the server from taking traffic; empty when it is fit."""
    found = []
    try:
        status, _ = _get(f"http://{url}/v2/health/ready", timeout_s)
        if status != 200:
            found.append(f"Triton is not ready (/v2/health/ready answered {status})")
        _, text = _get(f"http://{metrics_url}/metrics", timeout_s)
    except OSError as exc:
        return [f"server unreachable: {exc}"]
    samples = engine_samples(text)
    now = time.time()
    for model in models:
        up = samples.get(("personaplex_engine_up", model))
        beat = samples.get(("personaplex_engine_heartbeat_seconds", model))
        if up is None or beat is None:
            found.append(f"{model}: no engine metrics (model not loaded, or its stub process died)")
        elif up != 1:
            found.append(f"{model}: its engine stopped (see the server log)")
        elif now - beat > max_heartbeat_age_s:
            found.append(f"{model}: engine heartbeat {now - beat:.0f} s old (its stub process died or hangs)")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="localhost:8000", help="Triton's HTTP endpoint")
    parser.add_argument("--metrics-url", default="localhost:8002", help="Triton's metrics endpoint")
    parser.add_argument("--max-heartbeat-age", type=float, default=MAX_HEARTBEAT_AGE_S)
    args = parser.parse_args(argv)
    found = problems(args.url, args.metrics_url, max_heartbeat_age_s=args.max_heartbeat_age)
    print("\n".join(found) if found else "ok")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
