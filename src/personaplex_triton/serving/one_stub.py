"""Both stages in one stub (the one-stub repository's model `speech`): a frame crosses between
tritonserver and the stub twice, the client's request in and its audio out, where the two-stub
ensemble takes it across four times (the talker's request and response, code2wav's).

One engine serves both stages: its tick steps the talker, then decodes the frames it answered
(stages/one_tick.py), in one call, one process and one CUDA context (a child process with
`stage_process`, the default on a GPU); no hand-off, no second engine's tick to wait for.
Code2wav is built first, so that the talker sizes its pool from what code2wav left free. The
engine's metrics are the talker's, and code2wav's where true of it (`OneEngineMetrics`).

It answers a request as the ensemble does: one response (audio + text) per frame, in order, the
request's last frame completing it; an error after the audio of every frame that got that far.
"""

from __future__ import annotations

import numpy as np

from ..core import contract
from ..core.metrics import Metrics
from ..stages.one_tick import OneTickFrame
from ..stages.talker import text_piece
from .parameters import SpeechConfig
from .serving import TalkerService, load_log_lines
from .stage_builds import build_one_tick, open_stage

ONE_TICK_LOG = "speech: one tick steps the talker and decodes its frames"


class OneEngineMetrics(Metrics):
    """The one engine's metrics are the talker's. Those true of code2wav too are its as well, as
    dashboards and the health check (health.py) read each model's: the conversations (each holds
    a decoder stream), the frames answered (each was decoded), the heartbeat and the sends'
    backlog. Its ticks are the talker's alone: code2wav has none of its own."""

    def __init__(self, talker: Metrics, code2wav: Metrics):
        self.talker, self.code2wav = talker, code2wav

    def conversations(self, active: int, prefilling: int) -> None:
        self.talker.conversations(active, prefilling)
        self.code2wav.conversations(active, prefilling)

    def tick(self, seconds: float, frames: int) -> None:
        self.talker.tick(seconds, frames)

    def frame_answered(self, latency_s: float) -> None:
        self.talker.frame_answered(latency_s)
        self.code2wav.frame_answered(latency_s)

    def rejected(self, reason: str) -> None:
        self.talker.rejected(reason)

    def persona_cache_lookup(self, hit: bool) -> None:
        self.talker.persona_cache_lookup(hit)

    def alive(self, up: bool) -> None:
        self.talker.alive(up)
        self.code2wav.alive(up)

    def sends_behind(self, seconds: float) -> None:
        self.talker.sends_behind(seconds)
        self.code2wav.sends_behind(seconds)

    def loaded(self, slots: int, send_threads: int, mimi_part: str, mimi_runtime: str,
               warm_personas: list[str] | None = None, kv_dtype: str | None = None) -> None:
        self.talker.loaded(slots, send_threads, mimi_part, mimi_runtime, warm_personas, kv_dtype)

    def close(self) -> None:
        self.talker.close()
        self.code2wav.close()


class OneStubService(TalkerService):
    """The ensemble's contract (user audio in, agent audio + text out): the talker's service over
    one engine whose stage is both stages (stages/one_tick.OneTickStage), so a frame's answer is
    its audio and text. `code2wav_info`: code2wav's StageInfo."""

    def __init__(self, config: SpeechConfig, talker_metrics: Metrics | None = None,
                 code2wav_metrics: Metrics | None = None):
        code2wav_metrics = code2wav_metrics or Metrics()
        super().__init__(config, metrics=OneEngineMetrics(talker_metrics or Metrics(), code2wav_metrics))
        code2wav_metrics.loaded(self.code2wav_info.slots, self.engine.send_threads, "decoder", self.code2wav_info.mimi_runtime)

    def _open_stage(self, config: SpeechConfig):
        stage, (info, self.code2wav_info) = open_stage("speech", build_one_tick, config, self.metrics)
        return stage, info

    def _answer(self, conversation: int, frame: OneTickFrame, index: int, final: bool) -> dict:
        return {contract.AUDIO_OUT: frame.pcm.astype(np.float32),
                contract.TEXT_OUT: np.array([text_piece(self.tokenizer, frame.step.text_token).encode()], np.object_)}

    def _close_marker(self, conversation: int) -> None:
        return None  # no later stage to tell

    def load_log_lines(self) -> list[str]:
        """What the stages log once loaded (serving.load_log_lines), each under its own name."""
        threads = self.engine.send_threads
        return [*load_log_lines("talker", self.info, threads), *load_log_lines("code2wav", self.code2wav_info, threads),
                ONE_TICK_LOG]
