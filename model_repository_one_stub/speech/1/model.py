"""Both stages in one Python stub: user audio frames in, agent audio + text out, one response per
frame (the ensemble's contract), a frame crossing into and out of the stub once."""

import numpy as np

from personaplex_triton.core import contract, loaders
from personaplex_triton.serving.serving import pick_device, slots_log_line, warmed_log_line
from personaplex_triton.serving.speech import SpeechService
from personaplex_triton.serving.triton_adapter import (
    ConversationModel, TritonMetrics, instance_gpu, log_info, model_parameters, route_library_logs)

INPUTS = tuple(spec.name for spec in contract.INPUTS)


class TritonPythonModel(ConversationModel):
    def initialize(self, args):
        route_library_logs()
        params = model_parameters(args)
        service = SpeechService(
            loaders.checkpoint_spec(params.get("checkpoint", "")), params["max_conversations"],
            pick_device(params.get("device", "auto"), instance_gpu(args)), params["decoder_conversations"],
            params["mimi_runtime"], int(params.get("send_threads", "1")),
            # The stages' metrics keep their own labels: dashboards and the health check read them.
            talker_metrics=TritonMetrics("talker"), code2wav_metrics=TritonMetrics("code2wav"),
            idle_timeout_s=float(params["idle_timeout_s"]), persona_cache_size=int(params["persona_cache_size"]),
            warm_personas=params.get("warm_personas", ""), dtype=params.get("dtype", "auto"),
            kv_dtype=params.get("kv_dtype", "auto"),
            min_tick_interval_ms=float(params.get("min_tick_interval_ms", "0")))
        for stage, stage_service in (("talker", service.talker), ("code2wav", service.code2wav)):
            log_info(f"{stage}: {stage_service.mimi.describe()}")
            log_info(slots_log_line(stage, stage_service.slots, stage_service.slots_why))
        log_info(warmed_log_line("talker", service.talker.warmed))
        self.serve_conversations(args, service, INPUTS)

    def end_requests(self, key):
        return [(self.name, {contract.AUDIO_IN: np.zeros(0, np.float32)})]
