"""Mimi as explicit-state streaming steps, their runtimes (PyTorch, ONNX Runtime, TensorRT),
exported artefacts and per-slot streams. It imports only core (never lm)."""
