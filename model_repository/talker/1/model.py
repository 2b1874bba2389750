"""Stage 0 on Triton: decoupled, one response (agent codes + text) per input frame."""

import numpy as np

from personaplex_triton.core import contract, seam
from personaplex_triton.serving.parameters import TalkerConfig
from personaplex_triton.serving.sends_gauge import sends_behind_reader
from personaplex_triton.serving.serving import TalkerService, load_log_lines, seam_frame
from personaplex_triton.serving.triton_adapter import ConversationModel, TritonMetrics, log_info, route_library_logs

INPUTS = tuple(spec.name for spec in contract.INPUTS)
CODE2WAV = "code2wav"  # the next stage, whose sequences this one ends at shutdown


class TritonPythonModel(ConversationModel):
    def initialize(self, args):
        route_library_logs()
        service = TalkerService(TalkerConfig.from_triton(args), TritonMetrics(args["model_name"]),
                                downstream_behind_s=sends_behind_reader(CODE2WAV))
        for line in load_log_lines(args["model_name"], service.info, service.engine.send_threads):
            log_info(line)
        self.serve_conversations(args, service, INPUTS)

    def end_requests(self, key):
        """The requests that end sequence `key` in both stages. This engine has answered all its
        requests by now, so the end request reaches code2wav after the frames this engine sent it."""
        return [(self.name, {contract.AUDIO_IN: np.zeros(0, np.float32)}),
                (CODE2WAV, seam_frame(key, seam.CLOSE_ONLY, True, np.zeros(seam.NUM_AGENT_CODEBOOKS, np.int64), ""))]
