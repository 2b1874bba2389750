"""Server overhead: the same frames, one in flight, through the library's two services chained
in this process (the code each model.py calls, with its slot engines and tick loops) and
through Triton (gRPC stream, ensemble, Python backend stubs). The difference per frame is what
Triton adds.

The in-process side loads the server's checkpoint as this machine resolves it (the model
config's, else $PERSONAPLEX_CHECKPOINT, else checkpoints/tiny) at the server's pool sizes, so a
tick costs what it costs in the server when both run on one machine.
"""

from __future__ import annotations

import queue
import time

import numpy as np

from personaplex_stream import Persona, stream_conversation
from personaplex_triton.core import contract
from personaplex_triton.serving.one_stub import OneStubService
from personaplex_triton.serving.parameters import SpeechConfig

from . import stats
from .workload import persona_arrays


class InProcessPipeline:
    """Both stages in this process (`OneStubService`, as the one-stub repository's `speech` model
    runs them: one tick steps both); frames in, audio out."""

    def __init__(self, talker_slots: int, code2wav_slots: int, checkpoint: str):
        self.service = OneStubService(SpeechConfig(checkpoint=checkpoint, max_conversations=talker_slots,
                                                   code2wav_conversations=code2wav_slots, stage_process=False))
        self._answers: queue.Queue = queue.Queue()
        self._next_id = 1

    def conversation(self, frames: np.ndarray, persona: Persona, timeout_s: float = 600) -> list[float]:
        """One conversation, a frame at a time: each frame's send-to-audio latency in ms."""
        conversation, self._next_id = self._next_id, self._next_id + 1
        latencies = []
        for i, frame in enumerate(frames):
            arrays = {contract.AUDIO_IN: np.ascontiguousarray(frame, dtype=np.float32)}
            if i == 0:
                arrays.update(persona_arrays(persona))
            sent = time.perf_counter()
            self.service.handle(conversation, i == 0, i == len(frames) - 1, arrays,
                                lambda _audio, _last: self._answers.put(("audio", time.perf_counter())),
                                self._failed)
            try:
                kind, value = self._answers.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no audio for frame {i} in {timeout_s:.0f} s") from None
            if kind == "error":
                raise RuntimeError(f"in-process pipeline failed at frame {i}: {value}")
            latencies.append((value - sent) * 1000.0)
        return latencies

    def _failed(self, error: str | None) -> None:
        if error is not None:
            self._answers.put(("error", error))

    def close(self) -> None:
        self.service.close()


def compare(url: str, frames: np.ndarray, persona: Persona, talker_slots: int, code2wav_slots: int,
            checkpoint: str, log, rounds: int = 3) -> dict:
    """Per-frame latency in-process and through Triton (ms): p50 / p95 over every round, the
    difference of the medians, and that difference per round.

    The two sides take turns, a conversation each per round, so that the machine's drift (other
    load, clock, caches) falls on both alike; a frame here costs hundreds of ms on a CPU and
    varies by tens, so one pair of runs cannot show a few ms of overhead. Each side first runs a
    two-frame conversation of the persona so that neither pays its prefill.
    """
    log(f"[overhead] loading the checkpoint in this process ({talker_slots} talker slots, "
        f"{code2wav_slots} code2wav slots)")
    pipeline = InProcessPipeline(talker_slots, code2wav_slots, checkpoint)
    local, served, differences = [], [], []
    try:
        pipeline.conversation(frames[:2], persona)
        stream_conversation(frames[:2].reshape(-1), url=url, persona=persona, max_in_flight=1, check_ready=False)
        for r in range(rounds):
            log(f"[overhead] round {r + 1}/{rounds}: {len(frames)} frames in this process, then through Triton")
            here = pipeline.conversation(frames, persona)
            there = stream_conversation(frames.reshape(-1), url=url, persona=persona, max_in_flight=1,
                                        check_ready=False).latencies_ms
            differences.append(round(float(np.median(there) - np.median(here)), 1))
            local += here
            served += there
    finally:
        pipeline.close()
    served_p = stats.percentiles(served, (50, 95))
    local_p = stats.percentiles(local, (50, 95))
    return {"frames": len(frames), "rounds": rounds, "in_process_ms": local_p, "triton_ms": served_p,
            "overhead_ms_p50": round(served_p["p50"] - local_p["p50"], 1), "overhead_ms_per_round": differences}
