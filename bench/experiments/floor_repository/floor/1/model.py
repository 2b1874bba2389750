"""bench/experiments/crossings.py's floor: what tritonserver and a Python stub cost a frame with nothing
behind them. Each request's frames are answered at once, from execute, with the served
responses' tensors (the frame's samples back and an empty text piece; serving/triton_adapter's
responder), so a client sees the served contract at Triton's own cost."""

import numpy as np

from personaplex_triton.core import contract
from personaplex_triton.serving.triton_adapter import request_arrays, responder

TEXT = np.array([b""], dtype=np.object_)


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            send, finish, _ = responder(request)
            audio = request_arrays(request, (contract.AUDIO_IN,)).get(contract.AUDIO_IN)
            if audio is not None and audio.size % contract.FRAME_SAMPLES:
                finish(f"{contract.AUDIO_IN} must hold whole {contract.FRAME_SAMPLES}-sample frames, got {audio.size}")
                continue
            frames = [] if audio is None else audio.reshape(-1, contract.FRAME_SAMPLES)
            for i, frame in enumerate(frames):
                send({contract.AUDIO_OUT: frame, contract.TEXT_OUT: TEXT}, i == len(frames) - 1)
            finish(None)  # an end request without frames: its FINAL alone
        return None
