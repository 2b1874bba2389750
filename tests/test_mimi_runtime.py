"""The exported Mimi steps against moshi's own streaming Mimi, and how a runtime is chosen.

Parity runs the slot pool as the stages do: conversations in one batch that started at
different frames, in slots that are not consecutive, one of them reused after a reset, for
more frames than the 250-step attention window.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from personaplex_triton import audio, loaders, seam
from personaplex_triton.mimi_artefacts import metadata_path, onnx_path
from personaplex_triton.mimi_runtime import RuntimeUnavailable, open_step
from personaplex_triton.mimi_stream import MimiSlots

from conftest import REPO_ROOT, load_export_tool

FRAMES = 300
SLOTS = 4
# (slot, first tick) of each conversation; slot 2 first hosts a conversation that ends at
# tick 20, and is reset for the one that starts at tick 40.
CONVERSATIONS = ((3, 0), (0, 7), (2, 40))
THROWAWAY = (2, 0, 20)


@pytest.fixture(scope="session")
def files(tiny_checkpoint):
    return loaders.resolve_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="session")
def mimi(files):
    return loaders.get_mimi(files)


def run_pool(runner, streams: list[np.ndarray], throwaway: np.ndarray) -> list[np.ndarray]:
    """Each stream [frames, ...] through one MimiSlots pool, one tick at a time, started as
    CONVERSATIONS says; returns each stream's outputs, in order."""
    pool = MimiSlots(runner, SLOTS)
    outputs = [[] for _ in streams]
    step = pool.decode if runner.stage == "decoder" else pool.encode
    throwaway_slot, throwaway_start, throwaway_end = THROWAWAY
    ticks = max(start for _, start in CONVERSATIONS) + FRAMES
    for tick in range(ticks):
        items = {}
        for (slot, start), stream in zip(CONVERSATIONS, streams):
            if tick == start:
                pool.reset([slot])
            if start <= tick < start + FRAMES:
                items[slot] = stream[tick - start]
        if throwaway_start <= tick < throwaway_end:
            items[throwaway_slot] = throwaway[tick]
        results = step(items)
        for i, ((slot, start), _) in enumerate(zip(CONVERSATIONS, streams)):
            if start <= tick < start + FRAMES:
                outputs[i].append(np.asarray(results[slot]))
    return [np.stack(out) for out in outputs]


def random_codes(seed: int, frames: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, seam.CODEBOOK_SIZE, (frames, 8))


@torch.no_grad()
def moshi_decode(mimi, codes: list[np.ndarray]) -> list[np.ndarray]:
    """moshi's streaming decode, frame by frame, each conversation a row of one batch."""
    batch = torch.as_tensor(np.stack(codes))  # [B, frames, 8]
    with mimi.streaming(len(codes)):
        pcm = [mimi.decode(batch[:, t, :, None])[:, 0] for t in range(batch.shape[1])]
    return list(torch.stack(pcm, dim=1).numpy())  # B x [frames, 1920]


@torch.no_grad()
def moshi_encode(mimi, frames: list[np.ndarray]) -> list[np.ndarray]:
    batch = torch.as_tensor(np.stack(frames))  # [B, frames, 1920]
    with mimi.streaming(len(frames)):
        codes = [mimi.encode(batch[:, t, None, :])[:, :, 0] for t in range(batch.shape[1])]
    return list(torch.stack(codes, dim=1).numpy())  # B x [frames, 8]


def speech_frames(seed: int, frames: int) -> np.ndarray:
    """`frames` frames of the sample conversation, looped from a seed-dependent start, in noise."""
    pcm = audio.read_wav(REPO_ROOT / "samples" / "user.wav")
    rng = np.random.default_rng(seed)
    looped = np.roll(np.tile(pcm, frames * 1920 // len(pcm) + 1), -int(rng.integers(len(pcm))))
    noisy = looped[: frames * 1920] + 0.01 * rng.standard_normal(frames * 1920)
    return noisy.astype(np.float32).reshape(frames, 1920)


def test_onnxruntime_decoder_matches_moshi_streaming_decode(files, mimi):
    runner = open_step("decoder", files, "onnxruntime")
    codes = [random_codes(seed, FRAMES) for seed in range(len(CONVERSATIONS))]
    got = run_pool(runner, codes, throwaway=random_codes(99, FRAMES))
    want = moshi_decode(mimi, codes)
    for g, w in zip(got, want):
        assert g.shape == (FRAMES, 1920)
        assert np.abs(g - w).max() <= 1e-4
    assert np.abs(want[0]).max() > 1e-3  # the decoder makes sound, so the comparison means something


def test_onnxruntime_encoder_matches_moshi_streaming_encode(files, mimi):
    runner = open_step("encoder", files, "onnxruntime")
    frames = [speech_frames(seed, FRAMES) for seed in range(len(CONVERSATIONS))]
    got = run_pool(runner, frames, throwaway=speech_frames(99, FRAMES))
    want = moshi_encode(mimi, frames)
    for g, w in zip(got, want):
        assert g.shape == (FRAMES, 8)
        assert (g == w).mean() >= 0.999
    assert len(np.unique(want[0][:, 0])) > 10  # varied codes, not a constant


def test_auto_runs_onnxruntime_on_the_cpu_and_says_why_not_tensorrt(files):
    runner = open_step("decoder", files)
    assert runner.runtime == "onnxruntime"
    assert runner.source == str(onnx_path(files.mimi, "decoder"))
    assert "tensorrt: it needs a CUDA device" in runner.describe()


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
    with pytest.raises(RuntimeUnavailable, match="older mimi_steps.py"):
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
