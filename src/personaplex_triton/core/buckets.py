"""The fixed sizes a step's shapes are rounded up to, so that a few CUDA graphs, all captured
when the model loads, serve every tick: nothing a client sends makes the server capture another.

A step runs on the first `b` slots only, `b` a batch bucket (1, 2, 4, ... up to the pool), so a
tick of 3 conversations in slots 0..2 pays for 4 rows, not for the whole pool. The sampler's
top-k bound is rounded up to a bucket too (loaders.TOP_K_BUCKETS, TOP_K_TEXT_BUCKETS).
"""

from __future__ import annotations


def batch_buckets(num_slots: int) -> tuple[int, ...]:
    """The batch sizes a step runs at: powers of two below the pool, then the pool."""
    sizes = [1 << i for i in range(num_slots.bit_length()) if 1 << i < num_slots]
    return (*sizes, num_slots)


def bucket_for(value: int, buckets) -> int:
    """The smallest bucket >= value."""
    for bucket in buckets:
        if bucket >= value:
            return bucket
    raise ValueError(f"{value} is above the largest bucket {buckets[-1]}")
