"""Both stages in one process: the talker's frames go to code2wav without leaving it.

Through the ensemble a frame crosses between tritonserver and a Python stub four times (the
talker's request and response, code2wav's request and response), about half a millisecond each
(docs/gpu-serving-log.md). `SpeechService` serves both stages in one stub, so a frame crosses
twice: the client's request in, the audio out. By default (`one_tick`) one engine serves both:
its tick steps the talker, then decodes the frames it answered (stages/speech.py), in one call,
one process and one CUDA context (a child process with `stage_process`, the default on a GPU);
no hand-off, no second engine's tick to wait for. Its metrics are the talker's, and code2wav's
where true of it (`OneEngineMetrics`).

With `one_tick` false the two services of serving.py are chained: the talker's answer for a
frame is handed to code2wav's engine as a function call, and with `stage_process` each stage
runs in a child process and CUDA context of its own (engine/stage_process.py), code2wav's built
first so that the talker sizes its pool from what code2wav left free.

It answers a request as the ensemble does: one response (audio + text) per frame, in order, the
request's last frame completing it; an error after the audio of every frame that got that far.
"""

from __future__ import annotations

import threading

import numpy as np

from ..core import contract
from ..core.metrics import Metrics
from ..stages.speech import SpeechFrame
from ..stages.talker import text_piece
from .serving import Code2WavService, Finish, IsCancelled, Send, TalkerService, load_log_lines
from .stage_builds import build_speech, open_stage


class RequestAnswers:
    """One client request's answers, gathered from two stages: the talker says when it has sent
    its last frame (or failed), code2wav answers each frame it was sent; the request finishes
    once both have. A talker's error comes after the audio of the frames it sent before it; a
    code2wav error drops the request's later frames, and comes at once."""

    def __init__(self, send: Send, finish: Finish):
        self._send = send
        self._finish = finish
        self._lock = threading.Lock()
        self._in_code2wav = 0      # frames handed to code2wav and not yet finished by it
        self._talker_done = False
        self._talker_error: str | None = None
        self._code2wav_error: str | None = None
        self._finished = False

    def frame_to_code2wav(self) -> bool:
        """A frame of the talker's is about to go to code2wav; False once code2wav failed one."""
        with self._lock:
            if self._code2wav_error is not None:
                return False
            self._in_code2wav += 1
            return True

    def audio(self, outputs: dict, last: bool) -> None:
        with self._lock:
            if self._code2wav_error is not None:
                return
        self._send(outputs, last)

    def code2wav_done(self, error: str | None) -> None:
        with self._lock:
            self._in_code2wav -= 1
            if error is not None and self._code2wav_error is None:
                self._code2wav_error = f"code2wav: {error}"
        self._finish_if_done()

    def talker_done(self, error: str | None) -> None:
        with self._lock:
            self._talker_done = True
            self._talker_error = error
        self._finish_if_done()

    def _finish_if_done(self) -> None:
        with self._lock:
            if self._finished or (self._code2wav_error is None and (not self._talker_done or self._in_code2wav)):
                return
            self._finished = True
            error = self._code2wav_error or self._talker_error
        self._finish(error)


class OneEngineMetrics(Metrics):
    """The one engine's metrics (`one_tick`) are the talker's. Those true of code2wav too are its
    as well, as dashboards and the health check (health.py) read each model's: the conversations
    (each holds a decoder stream), the frames answered (each was decoded), the heartbeat and the
    sends' backlog. Its ticks are the talker's alone: code2wav has none of its own."""

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


class OneTickService(TalkerService):
    """The talker's service over one engine whose stage is both stages (stages/speech.Speech): a
    frame's answer is its audio and text. `code2wav_info`: code2wav's StageInfo."""

    def __init__(self, checkpoint: str, max_conversations: int | str, decoder_conversations: int | str = "auto",
                 **options):
        self._decoder_conversations = decoder_conversations
        super().__init__(checkpoint, max_conversations, **options)

    def _open_stage(self, options: dict, own_process: bool):
        stage, (info, self.code2wav_info) = open_stage(
            "speech", build_speech, {**options, "decoder_conversations": self._decoder_conversations}, own_process,
            self.metrics)
        return stage, info

    def _answer(self, conversation: int, frame: SpeechFrame, index: int, final: bool) -> dict:
        return {contract.AUDIO_OUT: frame.pcm.astype(np.float32),
                contract.TEXT_OUT: np.array([text_piece(self.tokenizer, frame.step.text_token).encode()], np.object_)}

    def _close_marker(self, conversation: int) -> None:
        return None  # no later stage to tell


class SpeechService:
    """The ensemble's contract (user audio in, agent audio + text out) served by the two stages
    chained in this process, or (`one_tick`) stepped in one engine's ticks."""

    def __init__(self, checkpoint: str, max_conversations: int | str, device: str = "cpu",
                 decoder_conversations: int | str = "auto", mimi_runtime: str = "auto", send_threads: int = 1,
                 idle_timeout_s: float = 60.0, stage_process: bool = False, talker_metrics: Metrics | None = None,
                 code2wav_metrics: Metrics | None = None, one_tick: bool = True, **talker_options):
        self.one_tick = one_tick
        if one_tick:
            code2wav_metrics = code2wav_metrics or Metrics()
            self.talker = OneTickService(checkpoint, max_conversations, decoder_conversations, device=device,
                                         idle_timeout_s=idle_timeout_s, mimi_runtime=mimi_runtime,
                                         send_threads=send_threads, stage_process=stage_process,
                                         metrics=OneEngineMetrics(talker_metrics or Metrics(), code2wav_metrics),
                                         **talker_options)
            code2wav = self.talker.code2wav_info
            code2wav_metrics.loaded(code2wav.slots, send_threads, "decoder", code2wav.mimi_runtime)
            self.code2wav = None
            return
        # code2wav first: on a GPU it takes its largest tick's memory before the talker sizes its pool.
        self.code2wav = Code2WavService(checkpoint, decoder_conversations, device, mimi_runtime, idle_timeout_s,
                                        send_threads=send_threads, stage_process=stage_process,
                                        metrics=code2wav_metrics)
        # The talker's answers go to code2wav in-process: one send thread keeps them in order cheaply.
        self.talker = TalkerService(checkpoint, max_conversations, device, idle_timeout_s, mimi_runtime=mimi_runtime,
                                    send_threads=1, stage_process=stage_process, metrics=talker_metrics,
                                    downstream_behind_s=self.code2wav.engine.sends_behind_s, **talker_options)

    def load_log_lines(self) -> list[str]:
        """What the stages log once loaded (serving.load_log_lines), each under its own name."""
        if self.one_tick:
            threads = self.talker.engine.send_threads
            return (load_log_lines("talker", self.talker.info, threads)
                    + load_log_lines("code2wav", self.talker.code2wav_info, threads)
                    + ["speech: one tick steps the talker and decodes its frames (one_tick)"])
        return [*load_log_lines("talker", self.talker.info, self.talker.engine.send_threads),
                *load_log_lines("code2wav", self.code2wav.info, self.code2wav.engine.send_threads)]

    def handle(self, conversation: int, start: bool, end: bool, arrays: dict, send: Send, finish: Finish,
               is_cancelled: IsCancelled | None = None) -> None:
        if self.one_tick:
            self.talker.handle(conversation, start, end, arrays, send, finish, is_cancelled)
            return
        answers = RequestAnswers(send, finish)

        def to_code2wav(seam_outputs: dict, last: bool) -> None:
            if answers.frame_to_code2wav():
                self.code2wav.handle(seam_outputs, lambda outputs, _: answers.audio(outputs, last),
                                     answers.code2wav_done)

        self.talker.handle(conversation, start, end, arrays, to_code2wav, answers.talker_done, is_cancelled)

    def drain(self, drain_s: float) -> None:
        """As the talker's (`TalkerService.drain`); code2wav answers what the talker sent it."""
        self.talker.drain(drain_s)

    def close(self) -> None:
        self.talker.close()
        if self.code2wav is not None:
            self.code2wav.close()

