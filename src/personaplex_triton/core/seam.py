"""What passes from stage 0 (`talker`) to stage 1 (`code2wav`), per frame.

The conversation id and frame index travel explicitly: `code2wav` keys its decoder state by
them (its sequence batcher only keeps a conversation on one instance, and the ensemble gives
every frame of a request that request's flags). `TENSORS` are the talker's outputs and
code2wav's inputs, written once.
"""

from .contract import TensorSpec

NUM_AGENT_CODEBOOKS = 8
CODEBOOK_SIZE = 2048  # Mimi's codes lie in [0, 2048)

AGENT_CODES = "AGENT_CODES"          # Mimi codebooks 0..7 of the agent, aligned for decoding
CONVERSATION_ID = "CONVERSATION_ID"  # the sequence's correlation id
FRAME_INDEX = "FRAME_INDEX"          # 0 for the conversation's first frame (decoder reset); frames
                                     # follow in order (a gap ends the conversation with an error)
FINAL = "FINAL"                      # true on the conversation's last frame (state freed)
TEXT_PIECE = "TEXT_PIECE"            # the frame's text, passed through to the client
TICK = "TICK"                        # (id, frames) of the talker tick that answered the frame:
                                     # code2wav's tick waits for all of them (engine/scheduler.py)

TENSORS = (
    TensorSpec(AGENT_CODES, "INT64", (NUM_AGENT_CODEBOOKS,)),
    TensorSpec(CONVERSATION_ID, "UINT64", (1,)),
    TensorSpec(FRAME_INDEX, "INT64", (1,)),
    TensorSpec(FINAL, "BOOL", (1,)),
    TensorSpec(TEXT_PIECE, "BYTES", (1,), optional=True),  # code2wav answers "" without it
    TensorSpec(TICK, "INT64", (2,), optional=True),  # without it, code2wav's tick does not wait
)

# FRAME_INDEX of a close marker: no frame (AGENT_CODES ignored, no audio out), only FINAL, for a
# conversation whose end request carried no frames.
CLOSE_ONLY = -1

# TICK of a frame that no talker tick answered with others (a close marker): a group of one.
ALONE = (0, 1)
