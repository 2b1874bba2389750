"""Both stages in one Python stub: user audio frames in, agent audio + text out, one response per
frame (the ensemble's contract), a frame crossing into and out of the stub once."""

import numpy as np

from personaplex_triton.core import contract, loaders
from personaplex_triton.serving.serving import pick_device
from personaplex_triton.serving.speech import SpeechService
from personaplex_triton.serving.stage_builds import one_tick, send_threads, stage_process, talker_options
from personaplex_triton.serving.triton_adapter import (
    ConversationModel, TritonMetrics, instance_gpu, log_info, model_parameters, route_library_logs)

INPUTS = tuple(spec.name for spec in contract.INPUTS)


class TritonPythonModel(ConversationModel):
    def initialize(self, args):
        route_library_logs()
        params = model_parameters(args)
        device = pick_device(params.get("device", "auto"), instance_gpu(args))
        own_process = stage_process(params, device)
        service = SpeechService(
            loaders.checkpoint_spec(params.get("checkpoint", "")), params["max_conversations"],
            device, params["decoder_conversations"],
            params["mimi_runtime"], send_threads(params, own_process),
            # The stages' metrics keep their own labels: dashboards and the health check read them.
            talker_metrics=TritonMetrics("talker"), code2wav_metrics=TritonMetrics("code2wav"),
            idle_timeout_s=float(params["idle_timeout_s"]), stage_process=own_process,
            one_tick=one_tick(params), **talker_options(params))
        for line in service.load_log_lines():
            log_info(line)
        self.serve_conversations(args, service, INPUTS)

    def end_requests(self, key):
        return [(self.name, {contract.AUDIO_IN: np.zeros(0, np.float32)})]
