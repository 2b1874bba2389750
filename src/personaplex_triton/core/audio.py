"""Audio helpers of the server library: the client package's WAV I/O, resampling and framing
(`personaplex_stream.audio`, numpy only, written once there), and loudness normalisation
(pyloudnorm), which only the server needs.

All audio here is float32 mono in [-1, 1] at `contract.SAMPLE_RATE` (24 kHz) unless a
function says otherwise.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
from personaplex_stream.audio import read_wav, resample, split_frames, write_wav

__all__ = ["read_wav", "write_wav", "resample", "split_frames", "loudness_normalize"]


def loudness_normalize(pcm: np.ndarray, sample_rate: int, target_lufs: float) -> np.ndarray:
    """Scale `pcm` so its integrated loudness (ITU-R BS.1770, pyloudnorm) is `target_lufs`.

    The gain is measured over the whole signal. Audio whose loudness cannot be measured
    (shorter than one 400 ms gating block, silent, or entirely below the -70 LUFS
    absolute gate) is returned unchanged rather than amplified to inf/nan. The result
    is float32 and is not clipped: a large positive gain can push peaks beyond 1.
    """
    import pyloudnorm  # imported here: only needed by callers that normalise

    pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
    block_size = 0.400
    if pcm.size < math.ceil(block_size * sample_rate) or not np.any(pcm):
        return pcm.copy()
    meter = pyloudnorm.Meter(sample_rate, block_size=block_size)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # log10(0) inside the meter on silent blocks
            loudness = meter.integrated_loudness(pcm.astype(np.float64))
    except ValueError:  # pyloudnorm's own input validation
        return pcm.copy()
    if not np.isfinite(loudness):
        return pcm.copy()
    gain = 10.0 ** ((float(target_lufs) - loudness) / 20.0)
    out = (pcm.astype(np.float64) * gain).astype(np.float32)
    if not np.all(np.isfinite(out)):
        return pcm.copy()
    return out
