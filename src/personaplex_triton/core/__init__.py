"""What every layer shares: the wire contract and seam, the checkpoint layout and defaults,
metrics, trace, faults, audio, buckets, repository paths. It imports nothing else of the package."""
