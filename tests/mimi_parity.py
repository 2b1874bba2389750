"""Parity harness for the Mimi runners: the slot pool as the stages run it, against moshi.

Conversations share one batch having started at different frames, in slots that are not
consecutive, one slot reused after a reset, for more frames than the attention window holds
(its ring of 250 positions takes two a frame: it wraps from frame 126 on); moshi's reference
runs each conversation as a row of its own streaming batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from personaplex_triton.core import audio, seam
from personaplex_triton.mimi.stream import MimiSlots

REPO_ROOT = Path(__file__).resolve().parents[1]

FRAMES = 150  # 300 positions: the rings wrap, and their first 50 entries are overwritten
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
    rings = {spec.shape[spec.ring] for spec in runner.state_specs if spec.ring is not None}
    assert rings and all(int(pool.state[0][slot]) > max(rings) for slot, _ in CONVERSATIONS)  # every ring wrapped
    return [np.stack(out) for out in outputs]


def random_codes(seed: int, frames: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, seam.CODEBOOK_SIZE, (frames, 8))


# moshi's reference takes up to this many frames a call while its rings fill, then one a
# call: its streaming state carries across calls as across frames, and until a ring is full
# a call of many frames sees what as many calls of one would (past that, moshi drops the
# oldest entries a call's keys displace, so only calls of one frame match the stages).
REFERENCE_CHUNK = 25


def reference_calls(mimi, frames: int) -> list[slice]:
    """The frames of each of moshi's calls: REFERENCE_CHUNK at a time while they fit in its
    rings, then one at a time."""
    context = min(m.context for m in mimi.modules() if isinstance(getattr(m, "context", None), int))
    filled = min(frames, int(context * mimi.frame_rate // mimi.encoder_frame_rate))  # two positions a frame
    return ([slice(t, min(t + REFERENCE_CHUNK, filled)) for t in range(0, filled, REFERENCE_CHUNK)]
            + [slice(t, t + 1) for t in range(filled, frames)])


@torch.no_grad()
def moshi_decode(mimi, codes: list[np.ndarray]) -> list[np.ndarray]:
    """moshi's streaming decode (calls as `reference_calls` says), each conversation a row of one batch."""
    batch = torch.as_tensor(np.stack(codes)).to(next(mimi.parameters()).device).transpose(1, 2)  # [B, 8, frames]
    with mimi.streaming(len(codes)):
        pcm = [mimi.decode(batch[..., call])[:, 0] for call in reference_calls(mimi, batch.shape[-1])]
    return list(torch.cat(pcm, dim=-1).float().cpu().numpy().reshape(len(codes), -1, 1920))  # B x [frames, 1920]


@torch.no_grad()
def moshi_encode(mimi, frames: list[np.ndarray]) -> list[np.ndarray]:
    """moshi's streaming encode (calls as `reference_calls` says), each conversation a row of one batch."""
    batch = torch.as_tensor(np.stack(frames)).to(next(mimi.parameters()).device)  # [B, frames, 1920]
    with mimi.streaming(len(frames)):
        codes = [mimi.encode(batch[:, call].reshape(len(frames), 1, -1))
                 for call in reference_calls(mimi, batch.shape[1])]
    return list(torch.cat(codes, dim=-1).transpose(1, 2).cpu().numpy())  # B x [frames, 8]


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
