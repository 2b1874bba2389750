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

from personaplex_triton.core import trace

from . import stats
from .workload import new_persona, persona_for

Log = Callable[[str], None]
NEW_PERSONA_AFTER_S = 5.0  # a new persona joins conversations under way, past their own starts


def conversations(url: str, frames: np.ndarray, n: int, log: Log, personas: list | None = None,
                  tolerate_errors: bool = False, start_after_s: list[float] | None = None) -> list:
    """n conversations of `frames` at once (seeds 0..n-1, or `personas`; conversation i starts
    `start_after_s[i]` seconds after the first); their ConversationResults in order, or with
    `tolerate_errors` the exception of each that failed (a server that refuses conversations
    past its slots). The first conversation reports its progress every 25 frames."""
    pcm = frames.reshape(-1)
    personas = personas or [persona_for(i) for i in range(n)]
    results: list = [None] * n
    errors: list = []
    started = time.monotonic()

    def progress(frame):
        if (frame.index + 1) % 25 == 0 or frame.index + 1 == frame.total:
            log(f"  {frame.index + 1}/{frame.total} frames of conversation 1 answered "
                f"({time.monotonic() - started:.0f} s)")

    def talk(i):
        time.sleep(start_after_s[i] if start_after_s else 0.0)
        try:
            results[i] = stream_conversation(pcm, url=url, persona=personas[i], realtime=True,
                                             check_ready=False, on_frame=progress if i == 0 else None)
        except Exception as exc:  # re-raised on the calling thread, naming the conversation
            errors.append((i, exc))
            results[i] = exc

    threads = [threading.Thread(target=talk, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors and not tolerate_errors:
        i, exc = errors[0]
        raise RuntimeError(f"conversation {i + 1} of {n} failed: {exc}") from exc
    return results


def load_row(n: int, results: list) -> dict:
    """The figures of one load level: every frame of every conversation served, first audio per
    conversation; conversations that failed (refused past the server's slots) are counted, and
    a level with any is not real time."""
    served = [r for r in results if not isinstance(r, Exception)]
    failed = [str(r) for r in results if isinstance(r, Exception)]
    latencies = [ms for r in served for ms in r.latencies_ms]
    first = [r.first_audio_ms for r in served]
    row = {"conversations": n, **stats.frame_summary(latencies),
           "failed": len(failed), "failures": sorted(set(failed))[:3],
           "first_audio_ms_p50": stats.percentiles(first, (50,))["p50"],
           "first_audio_ms_max": round(max(first), 1) if first else None,
           "frames_per_s": round(sum(r.frames_received for r in served) / max(r.wall_s for r in served), 2)
           if served else 0.0,
           "latencies_ms": [[round(ms, 1) for ms in r.latencies_ms] for r in served]}  # per conversation
    row["real_time"] = row["real_time"] and not failed
    return row


def sweep(url: str, frames: np.ndarray, levels: list[int], log: Log, new_personas: bool = False,
          trace_dir=None, gpu_memory=None) -> list[dict]:
    """Each level in turn. `new_personas`: at each level above 1 the last conversation has a
    persona the server has not seen and starts NEW_PERSONA_AFTER_S after the others, while they
    talk (its first audio is reported apart). `trace_dir`: the
    server's frame traces (PERSONAPLEX_TRACE_DIR, on this machine): each level's frames are
    followed through the stages. `gpu_memory()`: GiB in use, sampled at the end of each level."""
    rows = []
    for n in levels:
        log(f"[load] {n} conversation(s), {len(frames)} frames each, one every 80 ms")
        personas, start_after_s = [persona_for(i) for i in range(n)], [0.0] * n
        if new_personas and n > 1:
            personas[-1] = new_persona(f"{n}-{time.time_ns()}")
            start_after_s[-1] = NEW_PERSONA_AFTER_S
        results = conversations(url, frames, n, log, personas, tolerate_errors=True, start_after_s=start_after_s)
        row = load_row(n, results)
        if new_personas and n > 1 and not isinstance(results[-1], Exception):
            row["first_audio_ms_new_persona"] = round(results[-1].first_audio_ms, 1)
            cached = [r.first_audio_ms for r in results[:-1] if not isinstance(r, Exception)]
            row["first_audio_ms_p50"] = stats.percentiles(cached, (50,))["p50"]
        if trace_dir is not None:
            row["trace"] = trace.breakdown(trace_dir, [r for r in results if not isinstance(r, Exception)])
        if gpu_memory is not None:
            row["gpu_memory_gib"] = gpu_memory()
        log(f"  p50 {row['p50']} ms, p99 {row['p99']} ms, late {row['late']}/{row['frames']}, failed {row['failed']}, "
            f"first audio {row['first_audio_ms_p50']} ms: {'real time' if row['real_time'] else 'NOT real time'}")
        rows.append(row)
    return rows
