"""Both stages in one process: the talker's frames go to code2wav without leaving it.

Through the ensemble a frame crosses between tritonserver and a Python stub four times (the
talker's request and response, code2wav's request and response), about half a millisecond each
(docs/gpu-serving-log.md). `SpeechService` chains the two services of serving.py in one stub, so a
frame crosses twice: the client's request in, the audio out. The talker's answer for a frame is
handed to code2wav's engine as a function call. The stages' models share the stub's process and
CUDA context, or, with `stage_process` (the default on a GPU), each runs in a child process and
CUDA context of its own (engine/stage_process.py), code2wav's built first so that the talker
sizes its pool from what code2wav left free.

It answers a request as the ensemble does: one response (audio + text) per frame, in order, the
request's last frame completing it; an error after the audio of every frame that got that far.
"""

from __future__ import annotations

import threading

from ..core.metrics import Metrics
from .serving import Code2WavService, Finish, IsCancelled, Send, TalkerService


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


class SpeechService:
    """The ensemble's contract (user audio in, agent audio + text out) served by the two stages
    chained in this process."""

    def __init__(self, checkpoint: str, max_conversations: int | str, device: str = "cpu",
                 decoder_conversations: int | str = "auto", mimi_runtime: str = "auto", send_threads: int = 1,
                 idle_timeout_s: float = 60.0, stage_process: bool = False, talker_metrics: Metrics | None = None,
                 code2wav_metrics: Metrics | None = None, **talker_options):
        # code2wav first: on a GPU it takes its largest tick's memory before the talker sizes its pool.
        self.code2wav = Code2WavService(checkpoint, decoder_conversations, device, mimi_runtime, idle_timeout_s,
                                        send_threads=send_threads, stage_process=stage_process,
                                        metrics=code2wav_metrics)
        # The talker's answers go to code2wav in-process: one send thread keeps them in order cheaply.
        self.talker = TalkerService(checkpoint, max_conversations, device, idle_timeout_s, mimi_runtime=mimi_runtime,
                                    send_threads=1, stage_process=stage_process, metrics=talker_metrics,
                                    downstream_behind_s=self.code2wav.engine.sends_behind_s, **talker_options)

    def handle(self, conversation: int, start: bool, end: bool, arrays: dict, send: Send, finish: Finish,
               is_cancelled: IsCancelled | None = None) -> None:
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
        self.code2wav.close()

