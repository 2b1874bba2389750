"""Stage 1 on Triton: decoupled, one frame of agent codes in, 1920 PCM samples out."""

from personaplex_triton.core import loaders, seam
from personaplex_triton.serving.sends_gauge import SendsBehindWriter
from personaplex_triton.serving.serving import Code2WavService, load_log_lines, pick_device
from personaplex_triton.serving.shutdown import mark_finalized, register
from personaplex_triton.serving.stage_builds import send_threads, stage_process
from personaplex_triton.serving.triton_adapter import (
    TritonMetrics, instance_gpu, loaded, log_info, model_parameters, request_arrays, responder, route_library_logs)

INPUTS = tuple(spec.name for spec in seam.TENSORS)


class TritonPythonModel:
    def initialize(self, args):
        route_library_logs()
        params = model_parameters(args)
        device = pick_device(params.get("device", "auto"), instance_gpu(args))
        own_process = stage_process(params, device)
        self.service = Code2WavService(
            loaders.checkpoint_spec(params.get("checkpoint", "")), params["max_conversations"], device,
            params["mimi_runtime"], send_threads=send_threads(params, own_process),
            stage_process=own_process,
            # its backlog for the talker's admission, in another stub (sends_gauge.py)
            metrics=TritonMetrics(args["model_name"], SendsBehindWriter(args["model_name"], args["model_instance_name"])))
        for line in load_log_lines(args["model_name"], self.service.info, self.service.engine.send_threads):
            log_info(line)
        self.instance = args["model_instance_name"]
        register(self.instance, drains=False)  # the talker ends its sequences at shutdown
        loaded(self.instance)

    def execute(self, requests):
        for request in requests:
            send, finish, _ = responder(request)
            arrays = request_arrays(request, INPUTS)
            if arrays.get(seam.FRAME_INDEX, [None])[0] == 0:  # the conversation's first frame, on this instance
                log_info(f"{self.instance}: conversation {request.correlation_id()} starts")
            self.service.handle(arrays, send, finish)
        return None

    def finalize(self):
        self.service.close()
        mark_finalized(self.instance)
