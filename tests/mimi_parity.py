"""Parity harness for the Mimi runners: the slot pool as the stages run it, against moshi.

Conversations share one batch having started at different frames, in slots that are not
consecutive, one slot reused after a reset, for more frames than the 250-step attention
window; moshi's reference runs each conversation as a row of its own streaming batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from personaplex_triton.core import audio, seam
from personaplex_triton.mimi.stream import MimiSlots

REPO_ROOT = Path(__file__).resolve().parents[1]

FRAMES = 300
SLOTS = 4
# (slot, first tick) of each conversation; slot 2 first hosts a conversation that ends at
# tick 20, and is reset for the one that starts at tick 40.
CONVERSATIONS = ((3, 0), (0, 7), (2, 40))
THROWAWAY = (2, 0, 20)


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
        for i, (slot, start) in enumerate(CONVERSATIONS):
            if start <= tick < start + FRAMES:
                outputs[i].append(np.asarray(results[slot]))
    return [np.stack(out) for out in outputs]


def random_codes(seed: int, frames: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, seam.CODEBOOK_SIZE, (frames, 8))


@torch.no_grad()
def moshi_decode(mimi, codes: list[np.ndarray]) -> list[np.ndarray]:
    """moshi's streaming decode, frame by frame, each conversation a row of one batch."""
    batch = torch.as_tensor(np.stack(codes)).to(next(mimi.parameters()).device)  # [B, frames, 8]
    with mimi.streaming(len(codes)):
        pcm = [mimi.decode(batch[:, t, :, None])[:, 0] for t in range(batch.shape[1])]
    return list(torch.stack(pcm, dim=1).float().cpu().numpy())  # B x [frames, 1920]


@torch.no_grad()
def moshi_encode(mimi, frames: list[np.ndarray]) -> list[np.ndarray]:
    batch = torch.as_tensor(np.stack(frames)).to(next(mimi.parameters()).device)  # [B, frames, 1920]
    with mimi.streaming(len(frames)):
        codes = [mimi.encode(batch[:, t, None, :])[:, :, 0] for t in range(batch.shape[1])]
    return list(torch.stack(codes, dim=1).cpu().numpy())  # B x [frames, 8]


def speech_frames(seed: int, frames: int) -> np.ndarray:
    """`frames` frames of the sample conversation, looped from a seed-dependent start, in noise."""
    pcm = audio.read_wav(REPO_ROOT / "samples" / "user.wav")
    rng = np.random.default_rng(seed)
    looped = np.roll(np.tile(pcm, frames * 1920 // len(pcm) + 1), -int(rng.integers(len(pcm))))
    noisy = looped[: frames * 1920] + 0.01 * rng.standard_normal(frames * 1920)
    return noisy.astype(np.float32).reshape(frames, 1920)




def assert_parity(runner, mimi, max_abs_diff: float = 1e-4, codes_equal: float = 0.999) -> float:
    """The runner's decoded audio within `max_abs_diff` of moshi's, or its codes equal to
    moshi's on at least `codes_equal` of positions, for every conversation. Returns the worst
    difference, or the smallest fraction of equal codes."""
    n = len(CONVERSATIONS)
    if runner.stage == "decoder":
        codes = [random_codes(seed, FRAMES) for seed in range(n)]
        got = run_pool(runner, codes, throwaway=random_codes(99, FRAMES))
        want = moshi_decode(mimi, codes)
        assert np.abs(want[0]).max() > 1e-3  # the decoder makes sound: the comparison means something
        worst = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
        assert all(g.shape == (FRAMES, 1920) for g in got)
        assert worst <= max_abs_diff
        return worst
    else:
        frames = [speech_frames(seed, FRAMES) for seed in range(n)]
        got = run_pool(runner, frames, throwaway=speech_frames(99, FRAMES))
        want = moshi_encode(mimi, frames)
        assert len(np.unique(want[0][:, 0])) > 10  # varied codes, not a constant
        worst = min(float((g == w).mean()) for g, w in zip(got, want))
        assert all(g.shape == (FRAMES, 8) for g in got)
        assert worst >= codes_equal
        return worst
