"""The language model's batched step: KV cache, attention, fused ops, CUDA graphs, sampling,
generation and prefill over a pool of slots. It imports only core (never mimi)."""
