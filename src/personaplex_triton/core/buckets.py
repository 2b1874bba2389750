"""The fixed sizes a step's shapes are rounded up to, so that a few CUDA graphs, all captured
when the model loads, serve every tick: nothing a client sends makes the server capture another.

A step's rows are the frames it carries (a slot table maps them to their slots), rounded up to
a batch bucket: 1, 2, 4, 8, then every 8 up to 64 and every 16 past it, and the pool, so a tick
of 22 frames pays for 24 rows (a tick's cost grows with its rows: a bucket only a power of two
would pay for 32). The sampler's top-k bound is rounded up to a bucket too
(tunables.TOP_K_BUCKETS, TOP_K_TEXT_BUCKETS).
"""

from __future__ import annotations


def batch_buckets(num_slots: int) -> tuple[int, ...]:
    """The batch sizes a step runs at, below the pool, then the pool."""
    sizes = [1, 2, 4, *range(8, 64, 8), *range(64, num_slots, 16)]
    return (*(size for size in sizes if size < num_slots), num_slots)


def bucket_for(value: int, buckets) -> int:
    """The smallest bucket >= value."""
    for bucket in buckets:
        if bucket >= value:
            return bucket
    raise ValueError(f"{value} is above the largest bucket {buckets[-1]}")
