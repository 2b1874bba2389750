"""On a CUDA GPU, against a real tritonserver there: the served path of the GPU deployment.

`PERSONAPLEX_GPU_URL` names a server already running on this machine (the 7B one that
`scripts/gpu_host.sh serve` starts on the lent H200); without it a server is started on the
default checkpoint. Skipped without a CUDA GPU: CI has none, so these run on the device.
"""

import os
import threading

import numpy as np
import pytest
import torch

from personaplex_stream import Persona, stream_conversation
from personaplex_triton import audio, contract
from personaplex_triton.launch import REPO_ROOT, TritonServer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")

FRAMES = 50  # 4 s
OTHERS = 63


@pytest.fixture(scope="module")
def gpu_url(tmp_path_factory):
    if os.environ.get("PERSONAPLEX_GPU_URL"):
        yield os.environ["PERSONAPLEX_GPU_URL"]
        return
    with TritonServer(log_path=tmp_path_factory.mktemp("triton") / "tritonserver.log") as server:
        yield server.grpc_url


@pytest.fixture(scope="module")
def speech():
    return audio.read_wav(REPO_ROOT / "samples" / "user.wav")[: FRAMES * contract.FRAME_SAMPLES]


PROBE = Persona(voice="NATF0", text_prompt="You are a helpful assistant.", seed=7, greedy=True)


def test_one_output_frame_per_input_frame(gpu_url, speech):
    result = stream_conversation(speech, url=gpu_url, persona=PROBE, realtime=True)
    assert result.frames_sent == result.frames_received == FRAMES
    assert len(result.text_pieces) == FRAMES and result.audio.shape == (FRAMES * contract.FRAME_SAMPLES,)
    assert np.isfinite(result.audio).all() and result.audio.std() > 0


def test_greedy_tokens_alone_and_beside_63_others(gpu_url, speech):
    alone = stream_conversation(speech, url=gpu_url, persona=PROBE, realtime=True)
    others, errors = [], []

    def other(i):
        try:
            others.append(stream_conversation(
                speech, url=gpu_url, realtime=True, check_ready=False,
                persona=Persona(voice="NATM0" if i % 2 else "NATF0", text_prompt="You are a helpful assistant.",
                                seed=1000 + i)))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=other, args=(i,)) for i in range(OTHERS)]
    for t in threads:
        t.start()
    beside = stream_conversation(speech, url=gpu_url, persona=PROBE, realtime=True, check_ready=False)
    for t in threads:
        t.join()
    assert not errors and len(others) == OTHERS
    assert beside.text_pieces == alone.text_pieces
    # The codes are equal when the decoded audio is: one other code changes a frame entirely.
    # Within the tolerance: the decoder's batch (1 row alone, 64 beside) changes its kernels.
    np.testing.assert_allclose(beside.audio, alone.audio, atol=2e-3)
