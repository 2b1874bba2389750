"""The little that needs `triton_python_backend_utils`: tensors in and out of a request.

Importable only inside Triton's Python backend stub, which provides that module.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

SEQUENCE_START = 1  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
SEQUENCE_END = 2    # TRITONSERVER_REQUEST_FLAG_SEQUENCE_END


def model_parameters(args: dict) -> dict[str, str]:
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def instance_gpu(args: dict) -> int | None:
    """The GPU of a KIND_GPU instance (one per GPU with instance_group `gpus`), else None."""
    return int(args["model_instance_device_id"]) if args.get("model_instance_kind") == "GPU" else None


def log_info(message: str) -> None:
    """Into tritonserver's log (shown with --log-info, the default)."""
    pb_utils.Logger.log_info(message)


def request_arrays(request, names) -> dict[str, np.ndarray]:
    arrays = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            arrays[name] = tensor.as_numpy()
    return arrays


def sequence_flags(request) -> tuple[bool, bool]:
    flags = request.flags()
    return bool(flags & SEQUENCE_START), bool(flags & SEQUENCE_END)


def responder(request):
    """(send, finish) for a decoupled request: a response per call of send, then FINAL."""
    sender = request.get_response_sender()

    def send(outputs: dict[str, np.ndarray]) -> None:
        sender.send(pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, value) for name, value in outputs.items()]))

    def finish(error: str | None) -> None:
        if error is not None:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(error)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    return send, finish
