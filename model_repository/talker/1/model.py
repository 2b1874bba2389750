"""Stage 0 on Triton: decoupled, one response (agent codes + text) per input frame."""

import numpy as np

from personaplex_triton.core import contract, loaders, seam
from personaplex_triton.serving.serving import TalkerService, pick_device, seam_frame, slots_log_line, warmed_log_line
from personaplex_triton.serving.triton_adapter import (
    ConversationModel, TritonMetrics, instance_gpu, log_info, model_parameters, route_library_logs)

INPUTS = tuple(spec.name for spec in contract.INPUTS)
DECODER = "code2wav"  # the next stage, whose sequences this one ends at shutdown


class TritonPythonModel(ConversationModel):
    def initialize(self, args):
        route_library_logs()
        params = model_parameters(args)
        service = TalkerService(
            loaders.checkpoint_spec(params.get("checkpoint", "")), params["max_conversations"],
            pick_device(params.get("device", "auto"), instance_gpu(args)), float(params["idle_timeout_s"]),
            int(params["persona_cache_size"]), params["mimi_runtime"],
            params.get("warm_personas", ""), params.get("dtype", "auto"),
            params.get("kv_dtype", "auto"), float(params.get("min_tick_interval_ms", "0")),
            int(params.get("send_threads", "1")), metrics=TritonMetrics(args["model_name"]))
        log_info(f"{args['model_name']}: {service.mimi.describe()}")
        log_info(slots_log_line(args["model_name"], service.slots, service.slots_why))
        log_info(warmed_log_line(args["model_name"], service.warmed))
        self.serve_conversations(args, service, INPUTS)

    def end_requests(self, key):
        """The requests that end sequence `key` in both stages. This engine has answered all its
        requests by now, so the end request reaches code2wav after the frames this engine sent it."""
        return [(self.name, {contract.AUDIO_IN: np.zeros(0, np.float32)}),
                (DECODER, seam_frame(key, seam.CLOSE_ONLY, True, np.zeros(seam.NUM_AGENT_CODEBOOKS, np.int64), ""))]
