"""The language model's batched step over a pool of slots: KV cache, attention, fused ops, CUDA
graphs, sampling, generation and prefill. It may import core alone (never mimi)."""
