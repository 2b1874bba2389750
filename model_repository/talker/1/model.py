"""Stage 0 on Triton: decoupled, one response (agent codes + text) per input frame."""

import numpy as np

from personaplex_triton.core import contract, loaders, seam
from personaplex_triton.serving.serving import TalkerService, pick_device, seam_frame, slots_log_line, warmed_log_line
from personaplex_triton.serving.shutdown import Drain, OpenSequences, mark_finalized, register
from personaplex_triton.serving.triton_adapter import (
    TritonMetrics, instance_gpu, log_info, model_parameters, request_arrays, responder, route_library_logs,
    sequence_flags, sequence_idle_s)

INPUTS = tuple(spec.name for spec in contract.INPUTS)
DECODER = "code2wav"  # the next stage, whose sequences this one ends at shutdown


class TritonPythonModel:
    def initialize(self, args):
        route_library_logs()
        params = model_parameters(args)
        self.service = TalkerService(
            loaders.checkpoint_spec(params.get("checkpoint", "")), params["max_conversations"],
            pick_device(params.get("device", "auto"), instance_gpu(args)), float(params["idle_timeout_s"]),
            int(params["persona_cache_size"]), params["mimi_runtime"],
            params.get("warm_personas", ""), params.get("dtype", "auto"),
            params.get("kv_dtype", "auto"), float(params.get("min_tick_interval_ms", "0")),
            int(params.get("send_threads", "1")), metrics=TritonMetrics(args["model_name"]))
        log_info(f"{args['model_name']}: {self.service.mimi.describe()}")
        log_info(slots_log_line(args["model_name"], self.service.slots, self.service.slots_why))
        log_info(warmed_log_line(args["model_name"], self.service.warmed))
        self.name, self.instance = args["model_name"], args["model_instance_name"]
        # A sequence idle for twice the reaper's wait has been ended by it, without a word to us.
        self.sequences = OpenSequences(forget_after_s=2 * sequence_idle_s(args))
        self.drain = Drain.from_env(self.sequences, self._drain, self._end_requests, self.instance)
        register(self.instance, drains=True)

    def execute(self, requests):
        for request in requests:
            start, end = sequence_flags(request)
            self.sequences.note(int(request.correlation_id()), end)
            send, finish, is_cancelled = responder(request)
            if start:  # which instance holds the conversation: several run with instance_group count > 1
                log_info(f"{self.instance}: conversation {request.correlation_id()} starts")
            self.service.handle(int(request.correlation_id()), start, end,
                                request_arrays(request, INPUTS), send, finish, is_cancelled)
        return None

    def _drain(self, drain_s):
        log_info(f"{self.instance}: shutting down: no new conversations or requests; answering the pending ones")
        self.service.drain(drain_s)
        log_info(f"{self.instance}: drained; ending the open sequences")

    def _end_requests(self, key):
        """The requests that end sequence `key` in both stages. This engine has answered all its
        requests by now, so the end request reaches code2wav after the frames this engine sent it."""
        return [(self.name, {contract.AUDIO_IN: np.zeros(0, np.float32)}),
                (DECODER, seam_frame(key, seam.CLOSE_ONLY, True, np.zeros(seam.NUM_AGENT_CODEBOOKS, np.int64), ""))]

    def finalize(self):
        self.drain.stop()
        self.service.close()
        mark_finalized(self.instance)
