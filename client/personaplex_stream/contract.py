"""The wire contract of the `ensemble` model: what a client sends and receives.

It lives in the client package because both sides need it and the client must install
without the server's packages; the server library imports it from here (as
`personaplex_triton.core.contract`). `INPUTS` and `OUTPUTS` are the one place where the tensors'
types and shapes are written: the model configurations (`personaplex_triton.serving.model_configs`)
and the client are made from them.
"""

from dataclasses import dataclass

SAMPLE_RATE = 24_000
FRAME_RATE = 12.5
FRAME_SAMPLES = 1920  # 80 ms of 24 kHz mono audio: one model step

MODEL_NAME = "ensemble"

# Inputs. AUDIO_IN on every request; the persona fields only on the sequence-start request.
AUDIO_IN = "AUDIO_IN"          # n * FRAME_SAMPLES samples, mono, in [-1, 1]
VOICE = "VOICE"                # a voice name of the checkpoint ("NATF0")
TEXT_PROMPT = "TEXT_PROMPT"    # the role prompt
SEED = "SEED"                  # sampling seed of the conversation
GREEDY = "GREEDY"              # argmax instead of sampling
TEMPERATURE = "TEMPERATURE"    # audio sampling temperature
TEMPERATURE_TEXT = "TEMPERATURE_TEXT"
TOP_K = "TOP_K"                # audio top-k
TOP_K_TEXT = "TOP_K_TEXT"

# Outputs, one response per input frame, in order.
AUDIO_OUT = "AUDIO_OUT"        # FRAME_SAMPLES samples
TEXT_OUT = "TEXT_OUT"          # the frame's text piece, possibly empty

PERSONA_INPUTS = (VOICE, TEXT_PROMPT, SEED, GREEDY, TEMPERATURE, TEMPERATURE_TEXT, TOP_K, TOP_K_TEXT)

# Triton's wire datatypes and the numpy dtype of each (named, so that numpy need not be imported).
NUMPY_DTYPES = {"FP32": "float32", "INT32": "int32", "INT64": "int64", "UINT64": "uint64",
                "BOOL": "bool", "BYTES": "object"}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a model's interface: Triton datatype, dims (-1: any length), and whether
    an input may be left out of a request."""

    name: str
    datatype: str
    dims: tuple
    optional: bool = False


INPUTS = (
    # Optional to Triton so that a request without it reaches the talker, which names the problem
    # (the ensemble itself answers a missing required input with a bare final, no error).
    TensorSpec(AUDIO_IN, "FP32", (-1,), optional=True),
    TensorSpec(VOICE, "BYTES", (1,), optional=True),
    TensorSpec(TEXT_PROMPT, "BYTES", (1,), optional=True),
    TensorSpec(SEED, "INT64", (1,), optional=True),
    TensorSpec(GREEDY, "BOOL", (1,), optional=True),
    TensorSpec(TEMPERATURE, "FP32", (1,), optional=True),
    TensorSpec(TEMPERATURE_TEXT, "FP32", (1,), optional=True),
    TensorSpec(TOP_K, "INT32", (1,), optional=True),
    TensorSpec(TOP_K_TEXT, "INT32", (1,), optional=True),
)
OUTPUTS = (
    TensorSpec(AUDIO_OUT, "FP32", (FRAME_SAMPLES,)),
    TensorSpec(TEXT_OUT, "BYTES", (1,)),
)
SPECS = {spec.name: spec for spec in INPUTS + OUTPUTS}
