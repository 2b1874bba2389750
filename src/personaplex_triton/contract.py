"""The wire contract of the `ensemble` model: what a client sends and receives.

Kept free of heavy imports so that clients can use it without torch.
"""

SAMPLE_RATE = 24_000
FRAME_RATE = 12.5
FRAME_SAMPLES = 1920  # 80 ms of 24 kHz mono audio: one model step

MODEL_NAME = "ensemble"

# Inputs. AUDIO_IN on every request; the persona fields only on the sequence-start request.
AUDIO_IN = "AUDIO_IN"          # FP32 [n * FRAME_SAMPLES], mono, in [-1, 1]
VOICE = "VOICE"                # BYTES [1], a voice name of the checkpoint ("NATF0")
TEXT_PROMPT = "TEXT_PROMPT"    # BYTES [1], the role prompt
SEED = "SEED"                  # INT64 [1], sampling seed of the conversation
GREEDY = "GREEDY"              # BOOL [1], argmax instead of sampling
TEMPERATURE = "TEMPERATURE"    # FP32 [1], audio sampling temperature
TEMPERATURE_TEXT = "TEMPERATURE_TEXT"  # FP32 [1]
TOP_K = "TOP_K"                # INT32 [1], audio top-k
TOP_K_TEXT = "TOP_K_TEXT"      # INT32 [1]

# Outputs, one response per input frame, in order.
AUDIO_OUT = "AUDIO_OUT"        # FP32 [FRAME_SAMPLES]
TEXT_OUT = "TEXT_OUT"          # BYTES [1], the frame's text piece, possibly empty

PERSONA_INPUTS = (VOICE, TEXT_PROMPT, SEED, GREEDY, TEMPERATURE, TEMPERATURE_TEXT, TOP_K, TOP_K_TEXT)
