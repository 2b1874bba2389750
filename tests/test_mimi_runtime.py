"""The exported Mimi steps against moshi's own streaming Mimi (tests/mimi_parity.py), the
export tool, and how a runtime is chosen."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
from torch.nn import functional as F

from personaplex_triton.core import loaders
from personaplex_triton.mimi.artefacts import metadata_path, onnx_path
from personaplex_triton.mimi.runtime import RuntimeUnavailable, open_step

from conftest import load_export_tool
from mimi_parity import SLOTS, assert_parity


@pytest.fixture(scope="session")
def mimi(files):
    return loaders.get_mimi(files)


def test_onnxruntime_decoder_matches_moshi_streaming_decode(files, mimi):
    assert_parity(open_step("decoder", files, "onnxruntime"), mimi)


def test_onnxruntime_encoder_matches_moshi_streaming_encode(files, mimi):
    assert_parity(open_step("encoder", files, "onnxruntime"), mimi)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None, reason="tensorrt not installed")
@pytest.mark.parametrize("stage", ["decoder", "encoder"])
def test_tensorrt_matches_moshi_streaming(files, stage):
    load_export_tool("build_engine").main(
        ["--checkpoint", str(files.root), "--stage", stage, "--max-batch", str(SLOTS)])
    runner = open_step(stage, files, "tensorrt", "cuda")
    assert runner.runtime == "tensorrt"
    assert_parity(runner, loaders.get_mimi(files, "cuda"))


def test_auto_runs_onnxruntime_on_the_cpu_and_says_why_not_tensorrt(files):
    runner = open_step("decoder", files)
    assert runner.runtime == "onnxruntime"
    assert runner.source == str(onnx_path(files.mimi, "decoder"))
    assert "tensorrt: it needs a CUDA device" in runner.describe()


def test_onnxruntime_threads(files):
    """One intra-op thread when asked (the talker's encoder: it computes on its caller's
    thread), else every core."""
    import os

    one = open_step("encoder", files, "onnxruntime", threads=1).session.get_session_options()
    every = open_step("encoder", files, "onnxruntime").session.get_session_options()
    assert (one.intra_op_num_threads, every.intra_op_num_threads) == (1, len(os.sched_getaffinity(0)))


def test_forced_runtimes(files):
    assert open_step("encoder", files, "torch").runtime == "torch"
    with pytest.raises(RuntimeUnavailable, match="CUDA device"):
        open_step("decoder", files, "tensorrt")
    with pytest.raises(ValueError, match="mimi_runtime must be auto or one of tensorrt, onnxruntime, torch"):
        open_step("decoder", files, "openvino")
    with pytest.raises(ValueError, match="Mimi stage"):
        open_step("quantizer", files)


def test_missing_or_stale_export_falls_back_to_torch_or_fails_when_forced(files, tmp_path, monkeypatch):
    source = onnx_path(files.mimi, "decoder")
    monkeypatch.setenv("PERSONAPLEX_EXPORT_DIR", str(tmp_path))
    runner = open_step("decoder", files)
    assert runner.runtime == "torch"
    assert "run `make export`" in runner.describe()

    current = onnx_path(files.mimi, "decoder")  # under tmp_path now: the real export, relabelled
    current.parent.mkdir(parents=True)
    current.symlink_to(source)
    meta = json.loads(metadata_path(source).read_text())
    metadata_path(current).write_text(json.dumps({**meta, "step_sha256": "0" * 64}))
    with pytest.raises(RuntimeUnavailable, match="older mimi/steps.py"):
        open_step("decoder", files, "onnxruntime")
    metadata_path(current).write_text(json.dumps({**meta, "checkpoint_sha256": "0" * 64}))
    with pytest.raises(RuntimeUnavailable, match="other Mimi weights"):
        open_step("decoder", files, "onnxruntime")
    shutil.copy(metadata_path(source), metadata_path(current))
    assert open_step("decoder", files, "onnxruntime").runtime == "onnxruntime"


def test_export_metadata_and_cache(files, capsys):
    load_export_tool("export_mimi").main(["--checkpoint", str(files.root)])
    assert "decoder.onnx: current" in capsys.readouterr().out  # the session fixture exported it
    meta = json.loads(metadata_path(onnx_path(files.mimi, "decoder")).read_text())
    runner = open_step("decoder", files, "onnxruntime")
    inputs, outputs = runner.names
    assert [t["name"] for t in meta["inputs"]] == inputs
    assert [t["name"] for t in meta["outputs"]] == outputs
    assert meta["inputs"][0] == {"name": "codes", "shape": ["batch", 8, 1], "dtype": "int64"}
    assert meta["outputs"][0] == {"name": "pcm", "shape": ["batch", 1, 1920], "dtype": "float32"}
    assert meta["self_check"]["max_abs_diff"] <= 1e-4


def test_convs_as_matrix_products_match_torch(mimi):
    """The steps' convs and transposed convs (time-major matrix products over the laid-out
    weights, which ONNX Runtime runs far faster than its Conv and ConvTranspose) on a fresh
    stream, against the modules' own Conv1d on the causally padded input and ConvTranspose1d:
    every conv of Mimi, the depthwise 2x upsampler included, at batch 3 and a few lengths."""
    from moshi.modules.conv import StreamingConv1d, StreamingConvTranspose1d

    from personaplex_triton.mimi.steps import _conv, _conv_transpose, _StateIO, _Weights

    convs = [m for m in mimi.modules() if isinstance(m, StreamingConv1d)]
    transposed = [m for m in mimi.modules() if isinstance(m, StreamingConvTranspose1d)]
    assert len(transposed) == 5 and any(m.convtr.convtr.groups > 1 for m in transposed)
    weights, gen = _Weights(torch.nn.Module()), torch.Generator().manual_seed(0)
    for module in convs + transposed:
        inner = module.conv.conv if module in convs else module.convtr.convtr
        stride = inner.stride[0]
        for frames in (1, 2, 7):
            length = frames * (1 if module in transposed else stride)
            x = torch.randn(3, inner.in_channels, length, generator=gen)
            io = _StateIO(None, 3, x, weights)
            with torch.no_grad():
                if module in convs:
                    got = _conv(module, x.transpose(1, 2), io, first=torch.zeros(3, dtype=torch.bool))
                    want = inner(F.pad(x, (inner.kernel_size[0] - stride, 0)))
                else:
                    got = _conv_transpose(module, x.transpose(1, 2), io)
                    want = inner(x)[..., :length * stride]
            # fp32 sums of up to 512 channels x 7 taps in another order: 4.3e-5 apart at worst
            # on an AMD EPYC (2e-5 on the Xeons); a wrong tap or offset is off by the values' size
            torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-4, rtol=1e-4)


def test_write_state_puts_a_rings_new_entries_at_their_positions():
    """A ring's new entries go to `position % size` from each row's offset before the step
    (wrapping past the end), rows not stepped keep theirs, other states are replaced whole."""
    from personaplex_triton.mimi.steps import TensorSpec, write_state

    specs = [TensorSpec("offset", (), torch.long), TensorSpec("ring", (2, 4), torch.float32, ring=1),
             TensorSpec("buffer", (3,), torch.float32)]
    state = [torch.tensor([0, 3, 5]), torch.zeros(3, 2, 4), torch.zeros(3, 3)]
    new = torch.tensor([[[1.0, 2.0], [10.0, 20.0]], [[3.0, 4.0], [30.0, 40.0]]])  # [2 rows, 2, 2 entries]
    write_state(state, torch.tensor([1, 2]), [torch.tensor([5, 7]), new, torch.ones(2, 3)], specs)
    assert state[0].tolist() == [0, 5, 7]
    assert state[1][0].eq(0).all() and state[2][0].eq(0).all()
    assert state[1][1].tolist() == [[2.0, 0.0, 0.0, 1.0], [20.0, 0.0, 0.0, 10.0]]  # positions 3, 4 -> 3, 0
    assert state[1][2].tolist() == [[0.0, 3.0, 4.0, 0.0], [0.0, 30.0, 40.0, 0.0]]  # positions 5, 6 -> 1, 2
    assert state[2][1:].eq(1).all()


@pytest.mark.parametrize("stage", ["encoder", "decoder"])
def test_a_pools_step_touches_only_its_slots_rows(files, stage):
    """A MimiSlots pool keeps one spare row past its slots (a graphed step's padded rows write
    it); a step of some slots, apart or consecutive, changes their rows of every state tensor
    and leaves every other slot's rows as they were."""
    import numpy as np

    from personaplex_triton.mimi.stream import MimiSlots

    pool = MimiSlots(open_step(stage, files), SLOTS)
    assert pool.spare == SLOTS and all(t.shape[0] == SLOTS + 1 for t in pool.state)
    rng = np.random.default_rng(0)
    frame = (lambda: rng.integers(0, 2048, 8)) if stage == "decoder" else \
        (lambda: (0.1 * rng.standard_normal(1920)).astype(np.float32))
    step = pool.decode if stage == "decoder" else pool.encode
    for slots in ([0, 2], [1, 2]):  # apart, then consecutive
        before = [t.clone() for t in pool.state]
        step({s: frame() for s in slots})
        others = [s for s in range(SLOTS + 1) if s not in slots]
        assert all(torch.equal(b[others], t[others]) for b, t in zip(before, pool.state))
        assert all(not torch.equal(b[s], t[s]) for s in slots for b, t in zip(before[:1], pool.state[:1]))
