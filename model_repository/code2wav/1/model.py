"""Stage 1 on Triton: decoupled, one frame of agent codes in, 1920 PCM samples out."""

from personaplex_triton.core import seam
from personaplex_triton.serving.parameters import Code2WavConfig
from personaplex_triton.serving.sends_gauge import SendsBehindWriter
from personaplex_triton.serving.serving import Code2WavService, load_log_lines
from personaplex_triton.serving.shutdown import mark_finalized, register
from personaplex_triton.serving.triton_adapter import (
    TritonMetrics, loaded, log_info, request_arrays, responder, route_library_logs)

INPUTS = tuple(spec.name for spec in seam.TENSORS)


class TritonPythonModel:
    def initialize(self, args):
        route_library_logs()
        name = args["model_name"]
        # its backlog for the talker's admission, in another stub (sends_gauge.py)
        metrics = TritonMetrics(name, SendsBehindWriter(name, args["model_instance_name"]))
        self.service = Code2WavService(Code2WavConfig.from_triton(args), metrics)
        for line in load_log_lines(name, self.service.info, self.service.engine.send_threads):
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
