"""What passes from stage 0 (`talker`) to stage 1 (`code2wav`), per frame.

The conversation id and frame index travel explicitly so that `code2wav` keeps its
decoder state per conversation without relying on how Triton forwards sequence flags
through an ensemble.
"""

NUM_AGENT_CODEBOOKS = 8
CODEBOOK_SIZE = 2048  # Mimi's codes lie in [0, 2048)

AGENT_CODES = "AGENT_CODES"        # INT64 [8], Mimi codebooks 0..7 of the agent, aligned for decoding
CONVERSATION_ID = "CONVERSATION_ID"  # UINT64 [1], the sequence's correlation id
FRAME_INDEX = "FRAME_INDEX"        # INT64 [1], 0 for the conversation's first frame (decoder reset);
                                   # frames follow in order (a gap ends the conversation with an error)
FINAL = "FINAL"                    # BOOL [1], true on the conversation's last frame (state freed)
TEXT_PIECE = "TEXT_PIECE"          # BYTES [1], the frame's text, passed through to the client

# FRAME_INDEX of a close marker: no frame (AGENT_CODES ignored, no audio out), only FINAL, for a
# conversation whose end request carried no frames.
CLOSE_ONLY = -1
