"""Raw requests to the served `ensemble`, one per gRPC stream, for tests that need exact control
over what is sent (the client library sends only well-formed conversations); and how many
conversations the server's metrics say a model holds."""

from __future__ import annotations

import threading

import numpy as np
import tritonclient.grpc as grpcclient

from personaplex_stream import is_final_response
from personaplex_triton.core import contract
from personaplex_triton.core.metrics import scrape

DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64", np.dtype(np.int64): "INT64",
             np.dtype(np.int32): "INT32", np.dtype(np.bool_): "BOOL", np.dtype(np.object_): "BYTES"}


def tensor(name: str, value) -> grpcclient.InferInput:
    value = np.asarray(value)
    if value.dtype.kind in "SU":
        value = value.astype(np.object_)
    t = grpcclient.InferInput(name, list(value.shape), DATATYPES[value.dtype])
    t.set_data_from_numpy(value)
    return t


def voice_input(name):
    return tensor(contract.VOICE, np.array([name.encode()], dtype=np.object_))


def raw_request(server, frames_audio, sequence_id, start, end, extra=(), timeout_s=120):
    """One request on its own stream (AUDIO_IN left out when `frames_audio` is None);
    returns (responses with data, error message). Fails if no final answer comes."""
    responses, errors, done = [], [], threading.Event()

    def callback(result, error):
        if error is not None:
            errors.append(str(error))
            done.set()
            return
        if result.get_response().outputs:
            responses.append(result)
        if is_final_response(result):
            done.set()

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback)
    inputs = list(extra) if frames_audio is None else [tensor(contract.AUDIO_IN, frames_audio), *extra]
    client.async_stream_infer(contract.MODEL_NAME, inputs, sequence_id=sequence_id,
                              sequence_start=start, sequence_end=end, enable_empty_final_response=True)
    assert done.wait(timeout_s), "no final response"
    client.stop_stream()
    client.close()
    return responses, (errors[0] if errors else None)


def active(server, model="talker") -> float:
    """The conversations `model` holds a slot for, from the server's metrics."""
    return scrape(server.metrics_url)[f'personaplex_conversations_active{{model="{model}"}}']

