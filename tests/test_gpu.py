"""On a CUDA GPU: the CUDA-graphed step gives exactly the eager step's tokens, a
conversation's tokens do not depend on the others in the batch there either, and the PyTorch
Mimi steps (graphed and eager) match moshi's streaming Mimi."""

import pytest
import torch

from personaplex_triton import loaders
from personaplex_triton.generation import SlotGenerator, StepInputs
from personaplex_triton.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")

SLOTS = 4


@pytest.fixture(scope="module")
def lm():
    from moshi.models import loaders as moshi_loaders

    torch.manual_seed(0)
    model = moshi_loaders.get_moshi_lm(None, lm_kwargs={**loaders.PERSONAPLEX_LM_KWARGS, **loaders.TINY_LM_SIZE},
                                       device="cuda", dtype=torch.bfloat16)
    return model.eval()


def run(lm, cuda_graphs, live, steps=24):
    """Tokens of slot 0 over `steps` steps; slots in `live` (besides 0) run other inputs."""
    gen = SlotGenerator(lm, SLOTS, cuda_graphs=cuda_graphs)
    try:
        for slot in {0, *live}:
            gen.start(slot, SamplingParams(seed=100 + slot))
        rng = torch.Generator().manual_seed(1)
        active = torch.zeros(SLOTS, dtype=torch.bool)
        active[[0, *live]] = True
        out = []
        for _ in range(steps):
            user = torch.randint(0, 2048, (SLOTS, 8), generator=rng)
            user[0] = torch.randint(0, 2048, (8,), generator=torch.Generator().manual_seed(len(out)))
            none = torch.zeros(SLOTS, dtype=torch.bool)
            inputs = StepInputs(active.cuda(), user.cuda(), torch.zeros(SLOTS, 8, dtype=torch.long).cuda(),
                                none.cuda(), torch.zeros(SLOTS, dtype=torch.long).cuda(), none.cuda())
            tokens, has_output, _ = gen.step(inputs)
            if has_output[0]:
                out.append(tokens[0].cpu().tolist())
        return out
    finally:
        gen.close()


def test_cuda_graphs_match_eager(lm):
    assert run(lm, cuda_graphs=True, live=[1, 2, 3]) == run(lm, cuda_graphs=False, live=[1, 2, 3])


def test_alone_equals_batched_on_gpu(lm):
    assert run(lm, cuda_graphs=True, live=[]) == run(lm, cuda_graphs=True, live=[1, 2, 3])


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("stage", ["decoder", "encoder"])
def test_torch_mimi_step_on_gpu_matches_moshi_streaming(stage, cuda_graphs):
    """The PyTorch runtime (what a GPU without a TensorRT engine runs) on the generated
    checkpoint's Mimi, built in place: no checkpoint on disk needed. The pool's batch goes
    1, 2, 3 conversations, so the graphs run padded buckets."""
    from conftest import load_export_tool
    from mimi_parity import assert_parity
    from personaplex_triton.mimi_runtime import TorchStepRunner

    mimi = load_export_tool("make_tiny_checkpoint").build_mimi(seed=0).cuda()
    # Without TF32: cuDNN's TF32 convolutions (PyTorch's default) pick kernels by batch size,
    # so the pool's batches and moshi's round differently (measured: 99.7% of codes equal).
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        assert_parity(TorchStepRunner(stage, mimi, cuda_graphs=cuda_graphs), mimi)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
