"""The talker's slow ticks in a run's frame traces (core/trace.py), beside its usual ones: what
else happened while they ran, to tell the card from the talker's process.

For the ticks over `--over-ms` and for the usual ones (within a quarter of the median tick's
time), medians of: the tick's time and frames; how long the previous tick's answers took to
leave (its last send after its end); the sends that completed during the tick and the frames
that arrived meanwhile, per millisecond; code2wav's ticks over the same time (its process
shares the card: a stalled card slows them too); and the tick's time off the CPU, where the
trace keeps the tick's CPU time. Then how far apart the slow ticks come.

    python -m bench.experiments.slow_ticks TRACE_DIR [--over-ms 60]

`scripts/gpu_host.sh traces DIR` brings a run's traces back as DIR/trace.tar.xz; untar it and
name the `trace` folder inside.
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.ticks import tick_table
from personaplex_triton.core import trace


def _median(values) -> float | None:
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    return round(float(np.median(values)), 2) if values.size else None


def slow_tick_figures(talker: list[dict], code2wav: list[dict], over_ms: float = 60.0) -> dict:
    """The figures above, from both stages' frame records (trace.read)."""
    t = tick_table(talker)
    if len(t["start"]) < 2:
        raise ValueError("the talker's trace holds fewer than two ticks")
    ms = 1000 * (t["end"] - t["start"])
    sent = np.sort([r["sent"] for r in talker])
    arrived = np.sort([r["queued"] for r in talker])
    c = tick_table(code2wav) if code2wav else None

    def during(times, i):  # how many of `times` (sorted) fall within tick i
        return np.searchsorted(times, t["end"][i]) - np.searchsorted(times, t["start"][i])

    def figures(chosen: np.ndarray) -> dict:
        chosen = chosen[chosen > 0]  # each needs the tick before it
        overlapping = [] if c is None else [
            1000 * (c["end"][k] - c["start"][k]) for i in chosen
            for k in np.nonzero((c["start"] < t["end"][i]) & (c["end"] > t["start"][i]))[0]]
        return {"ticks": int(chosen.size), "tick_ms": _median(ms[chosen]), "frames": _median(t["frames"][chosen]),
                "previous_sends_ms": _median(1000 * (t["last_sent"][chosen - 1] - t["end"][chosen - 1])),
                "sends_per_ms": _median([during(sent, i) / ms[i] for i in chosen]),
                "arrivals_per_ms": _median([during(arrived, i) / ms[i] for i in chosen]),
                "code2wav_tick_ms": _median(overlapping),
                "off_cpu_ms": _median(t["off_cpu_ms"][chosen])}

    median = float(np.median(ms))
    slow = np.nonzero(ms > over_ms)[0]
    usual = np.nonzero(np.abs(ms - median) <= median / 4)[0]
    apart = np.diff(t["start"][slow])
    return {"ticks": len(ms), "tick_ms_p50": round(median, 2), "over_ms": over_ms, "slow": figures(slow),
            "usual": figures(usual),
            "slow_apart_s_p50": round(float(np.median(apart)), 2) if apart.size else None,
            "slow_next_to_slow": int(np.sum(np.diff(slow) == 1))}


def report(found: dict) -> str:
    """The figures as a markdown table and a line."""
    columns = [("ticks", "ticks"), ("tick_ms", "tick (ms)"), ("frames", "frames"),
               ("previous_sends_ms", "previous tick's sends (ms)"), ("sends_per_ms", "sends a ms"),
               ("arrivals_per_ms", "arrivals a ms"), ("code2wav_tick_ms", "code2wav's ticks meanwhile (ms)"),
               ("off_cpu_ms", "off the CPU (ms)")]
    lines = [f"{found['ticks']} talker ticks, median {found['tick_ms_p50']} ms; medians of the slow ones "
             f"(over {found['over_ms']:g} ms) and the usual ones (within a quarter of the median):", "",
             "| which | " + " | ".join(title for _, title in columns) + " |",
             "| --- |" + " ---: |" * len(columns)]
    for kind in ("slow", "usual"):
        cells = ["-" if found[kind][key] is None else f"{found[kind][key]:g}" for key, _ in columns]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines += ["", f"Slow ticks come {found['slow_apart_s_p50']} s apart (median); "
                  f"{found['slow_next_to_slow']} follow another slow one."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir", help="a run's frame traces (PERSONAPLEX_TRACE_DIR)")
    parser.add_argument("--over-ms", type=float, default=60.0, help="a tick over this is slow")
    args = parser.parse_args(argv)
    found = slow_tick_figures(trace.read(args.trace_dir, "talker"), trace.read(args.trace_dir, "code2wav"),
                              args.over_ms)
    print(report(found))


if __name__ == "__main__":
    main()
