"""Both stages in one Python stub: user audio frames in, agent audio + text out, one response per
frame (the ensemble's contract), a frame crossing into and out of the stub once."""

import numpy as np

from personaplex_triton.core import contract, loaders
from personaplex_triton.serving.serving import pick_device, slots_log_line, warmed_log_line
from personaplex_triton.serving.shutdown import Drain, OpenSequences, mark_finalized, register
from personaplex_triton.serving.speech import SpeechService
from personaplex_triton.serving.triton_adapter import (
    TritonMetrics, instance_gpu, log_info, model_parameters, request_arrays, responder, route_library_logs,
    sequence_flags, sequence_idle_s)

INPUTS = tuple(spec.name for spec in contract.INPUTS)


class TritonPythonModel:
    def initialize(self, args):
        route_library_logs()
        params = model_parameters(args)
        self.service = SpeechService(
            loaders.checkpoint_spec(params.get("checkpoint", "")), params["max_conversations"],
            pick_device(params.get("device", "auto"), instance_gpu(args)), params["decoder_conversations"],
            params["mimi_runtime"], int(params.get("send_threads", "1")),
            # The stages' metrics keep their own labels: dashboards and the health check read them.
            talker_metrics=TritonMetrics("talker"), code2wav_metrics=TritonMetrics("code2wav"),
            idle_timeout_s=float(params["idle_timeout_s"]), persona_cache_size=int(params["persona_cache_size"]),
            warm_personas=params.get("warm_personas", ""), dtype=params.get("dtype", "auto"),
            kv_dtype=params.get("kv_dtype", "auto"),
            min_tick_interval_ms=float(params.get("min_tick_interval_ms", "0")))
        talker, code2wav = self.service.talker, self.service.code2wav
        log_info(f"talker: {talker.mimi.describe()}")
        log_info(f"code2wav: {code2wav.mimi.describe()}")
        log_info(slots_log_line("talker", talker.slots, talker.slots_why))
        log_info(slots_log_line("code2wav", code2wav.slots, code2wav.slots_why))
        log_info(warmed_log_line("talker", talker.warmed))
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
            if start:
                log_info(f"{self.instance}: conversation {request.correlation_id()} starts")
            self.service.handle(int(request.correlation_id()), start, end,
                                request_arrays(request, INPUTS), send, finish, is_cancelled)
        return None

    def _drain(self, drain_s):
        log_info(f"{self.instance}: shutting down: no new conversations or requests; answering the pending ones")
        self.service.drain(drain_s)
        log_info(f"{self.instance}: drained; ending the open sequences")

    def _end_requests(self, key):
        return [(self.name, {contract.AUDIO_IN: np.zeros(0, np.float32)})]

    def finalize(self):
        self.drain.stop()
        self.service.close()
        mark_finalized(self.instance)
