"""core/gpu_waits.py off a GPU: nothing to do (its effect is tested on a GPU, tests/test_gpu.py)."""

from personaplex_triton.core import gpu_waits


def test_off_a_gpu_nothing_is_set():
    assert gpu_waits.sleep_while_gpu_works("cpu") is False
