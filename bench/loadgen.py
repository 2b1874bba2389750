"""Real-time load: N conversations at once, each sending one frame every 80 ms on an absolute
schedule (as a live microphone does, whatever the server's pace), through the gRPC client.

A frame's latency runs from its send to its answer, so a server slower than real time shows as
latencies that grow along the conversation, not as a slower sender.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np

from personaplex_stream import stream_conversation

from . import stats
from .workload import persona_for

Log = Callable[[str], None]


def conversations(url: str, frames: np.ndarray, n: int, log: Log) -> list:
    """n conversations of `frames` at once (seeds 0..n-1); their ConversationResults in order.
    The first conversation reports its progress every 25 frames."""
    pcm = frames.reshape(-1)
    results: list = [None] * n
    errors: list = []
    started = time.monotonic()

    def progress(received, total):
        if received % 25 == 0 or received == total:
            log(f"  {received}/{total} frames of conversation 1 answered ({time.monotonic() - started:.0f} s)")

    def talk(i):
        try:
            results[i] = stream_conversation(pcm, url=url, persona=persona_for(i), realtime=True,
                                             check_ready=False, on_progress=progress if i == 0 else None)
        except Exception as exc:  # re-raised on the calling thread, naming the conversation
            errors.append((i, exc))

    threads = [threading.Thread(target=talk, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        i, exc = errors[0]
        raise RuntimeError(f"conversation {i + 1} of {n} failed: {exc}") from exc
    return results


def load_row(n: int, results: list) -> dict:
    """The figures of one load level: every frame of every conversation, first audio per conversation."""
    latencies = [ms for r in results for ms in r.latencies_ms]
    first = [r.first_audio_ms for r in results]
    return {"conversations": n, **stats.frame_summary(latencies),
            "first_audio_ms_p50": stats.percentiles(first, (50,))["p50"],
            "first_audio_ms_max": round(max(first), 1),
            "frames_per_s": round(sum(r.frames_received for r in results) / max(r.wall_s for r in results), 2),
            "latencies_ms": [[round(ms, 1) for ms in r.latencies_ms] for r in results]}  # per conversation


def sweep(url: str, frames: np.ndarray, levels: list[int], log: Log) -> list[dict]:
    rows = []
    for n in levels:
        log(f"[load] {n} conversation(s), {len(frames)} frames each, one every 80 ms")
        row = load_row(n, conversations(url, frames, n, log))
        log(f"  p50 {row['p50']} ms, p99 {row['p99']} ms, late {row['late']}/{row['frames']}, "
            f"first audio {row['first_audio_ms_p50']} ms: {'real time' if row['real_time'] else 'NOT real time'}")
        rows.append(row)
    return rows
