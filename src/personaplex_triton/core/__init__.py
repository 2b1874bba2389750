"""The ground floor: the wire contract and seam, checkpoint layout and defaults, metrics, trace,
faults, audio, buckets and repository paths. It imports nothing else of personaplex_triton."""
