"""Mimi as explicit-state streaming steps, their runtimes (PyTorch, ONNX Runtime, TensorRT), the
exported artefacts and per-slot streams. It may import core alone (never lm)."""
