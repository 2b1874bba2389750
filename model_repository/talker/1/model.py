"""Stage 0 on Triton: decoupled, one response (agent codes + text) per input frame."""

from personaplex_triton import contract, loaders
from personaplex_triton.serving import TalkerService, pick_device, slots_log_line, warmed_log_line
from personaplex_triton.triton_adapter import (
    TritonMetrics, instance_gpu, log_info, model_parameters, request_arrays, responder, sequence_flags)

INPUTS = (contract.AUDIO_IN, *contract.PERSONA_INPUTS)


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.service = TalkerService(
            loaders.checkpoint_spec(params.get("checkpoint", "")), params["max_conversations"],
            pick_device(params.get("device", "auto"), instance_gpu(args)), float(params["idle_timeout_s"]),
            int(params["persona_cache_size"]), params["mimi_runtime"],
            params.get("warm_personas", ""), params.get("dtype", "auto"), metrics=TritonMetrics(args["model_name"]))
        log_info(f"{args['model_name']}: {self.service.mimi.describe()}")
        log_info(slots_log_line(args["model_name"], self.service.slots, self.service.slots_why))
        log_info(warmed_log_line(args["model_name"], self.service.warmed))
        self.instance = args["model_instance_name"]

    def execute(self, requests):
        for request in requests:
            start, end = sequence_flags(request)
            send, finish, is_cancelled = responder(request)
            if start:  # which instance holds the conversation: several run with instance_group count > 1
                log_info(f"{self.instance}: conversation {request.correlation_id()} starts")
            self.service.handle(int(request.correlation_id()), start, end,
                                request_arrays(request, INPUTS), send, finish, is_cancelled)
        return None

    def finalize(self):
        self.service.close()
