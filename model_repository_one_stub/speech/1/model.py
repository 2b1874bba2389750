"""Both stages in one Python stub: user audio frames in, agent audio + text out, one response per
frame (the ensemble's contract), a frame crossing into and out of the stub once."""

import numpy as np

from personaplex_triton.core import contract
from personaplex_triton.serving.one_stub import OneStubService
from personaplex_triton.serving.parameters import SpeechConfig
from personaplex_triton.serving.triton_adapter import ConversationModel, TritonMetrics, log_info, route_library_logs

INPUTS = tuple(spec.name for spec in contract.INPUTS)


class TritonPythonModel(ConversationModel):
    def initialize(self, args):
        route_library_logs()
        # The stages' metrics keep their own labels: dashboards and the health check read them.
        service = OneStubService(SpeechConfig.from_triton(args), TritonMetrics("talker"), TritonMetrics("code2wav"))
        for line in service.load_log_lines():
            log_info(line)
        self.serve_conversations(args, service, INPUTS)

    def end_requests(self, key):
        return [(self.name, {contract.AUDIO_IN: np.zeros(0, np.float32)})]
