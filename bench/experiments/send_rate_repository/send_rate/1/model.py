"""bench/experiments/send_rate.py's model: each request is answered with COUNT responses of the served shape
(a frame of audio and a text piece), put into the project's outbox (engine/outbox.py) with LANES
send threads and sent as the served stages send (serving/triton_adapter.responder). Each response
carries when it was put and when its send began (this process's monotonic clock, seconds)."""

import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from personaplex_triton.core import contract
from personaplex_triton.engine.outbox import Outbox
from personaplex_triton.serving.triton_adapter import log_info, responder

AUDIO = np.zeros(contract.FRAME_SAMPLES, np.float32)
TEXT = np.array([" word".encode()], dtype=object)


def scalar(request, name: str) -> int:
    return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy()[0])


class TritonPythonModel:
    def initialize(self, args):
        self._outboxes: dict[int, Outbox] = {}
        self._lock = threading.Lock()

    def _outbox(self, lanes: int) -> Outbox:
        with self._lock:
            if lanes not in self._outboxes:
                self._outboxes[lanes] = Outbox(f"send-rate-{lanes}", self._deliver, self._failed, lanes=lanes,
                                               lane_of=lambda answer: answer[0])
            return self._outboxes[lanes]

    def execute(self, requests):
        for request in requests:
            count, lanes, stream = (scalar(request, name) for name in ("COUNT", "LANES", "STREAM"))
            send, _, _ = responder(request)
            outbox = self._outbox(lanes)
            for i in range(count):
                outbox.put([(stream, send, time.monotonic(), i == count - 1)])
        return None

    def _deliver(self, answers: list) -> None:
        for _, send, put_at, last in answers:
            send({contract.AUDIO_OUT: AUDIO, contract.TEXT_OUT: TEXT,
                  "TIMES": np.array([put_at, time.monotonic()])}, last)

    def _failed(self, exc: Exception) -> None:
        log_info(f"send_rate: a delivery failed: {exc!r}")

    def finalize(self):
        for outbox in self._outboxes.values():
            outbox.close()
