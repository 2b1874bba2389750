"""Fidelity: with greedy sampling, the talker emits exactly the tokens of PersonaPlex's own
reference generation code (NVIDIA/personaplex, moshi/moshi/models/lm.py `LMGen`), on the same
weights, prompts and input audio: text and the agent's 8 codebooks of every frame.

`tests/data/reference_tokens.json` holds the reference's tokens on the generated checkpoint,
one recording per checkpoint digest (the generator calibrates the random weights with forward
passes, whose last bits vary with the CPU's vector units: three kinds seen here, an Intel Xeon
with AVX-512, an AMD EPYC and an AMD EPYC with AVX2 only, each build their own), recorded with a checkout of NVIDIA/personaplex (commit 3428dfd) by

    PERSONAPLEX_REFERENCE=/path/to/personaplex/moshi .venv/bin/python tests/test_fidelity.py --record

With PERSONAPLEX_REFERENCE set, `test_matches_reference_live` also reruns the reference now.
"""

import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from personaplex_triton.core import audio, loaders
from personaplex_triton.lm.sampling import SamplingParams
from personaplex_triton.mimi.runtime import open_step
from personaplex_triton.stages.persona import Persona, load_voice, system_prompt_tokens
from personaplex_triton.stages.talker import Talker, TalkerSetup

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "data" / "reference_tokens.json"
DRIVER = HERE / "reference_driver.py"
USER_WAV = HERE.parent / "samples" / "user.wav"
PROMPT = "You are a wise and friendly teacher. Answer questions or provide advice in a clear and engaging way."
VOICES = ("NATF0.wav", "NATF0.pt")
REFERENCE = os.environ.get("PERSONAPLEX_REFERENCE")
RECORDED_FRAMES = 50  # compared of the 100 recorded (4 s of the user's speech); the live test compares all


@functools.cache
def weights_digest(checkpoint: Path) -> str:
    digest = hashlib.sha256()
    for name in (loaders.MOSHI_NAME, loaders.MIMI_NAME, loaders.TOKENIZER_NAME):
        digest.update((checkpoint / name).read_bytes())
    return digest.hexdigest()


def our_tokens(checkpoint: Path, voice: str, first: int | None = None) -> list[list[int]]:
    """Text token + agent cb0..7 per user frame (the `first` frames, None: all), greedy, on a
    one-slot talker."""
    files = loaders.resolve_checkpoint(checkpoint)
    tokenizer = loaders.get_tokenizer(files)
    talker = Talker(loaders.get_lm(files), open_step("encoder", files), tokenizer, 1)
    persona = Persona(load_voice(files.voices / voice), system_prompt_tokens(tokenizer, PROMPT))
    talker.prefill(0, TalkerSetup(persona, SamplingParams(greedy=True)))
    frames = audio.split_frames(audio.read_wav(USER_WAV))[:first]
    tokens = []
    while len(tokens) < len(frames):
        steps = talker.tick({0: frames[len(tokens)]})
        if 0 in steps:
            tokens.append([steps[0].text_token, *map(int, steps[0].codes)])
    talker.close()
    return tokens


def reference_tokens(checkpoint: Path, voice: str) -> list[list[int]]:
    env = {**os.environ, "PYTHONPATH": REFERENCE, "NO_TORCH_COMPILE": "1"}
    run = subprocess.run([sys.executable, str(DRIVER), str(checkpoint), str(checkpoint / "voices" / voice),
                          PROMPT, str(USER_WAV)], env=env, capture_output=True, text=True, check=True)
    return [frame[:9] for frame in json.loads(run.stdout.strip().splitlines()[-1])]


@pytest.mark.parametrize("voice", VOICES)
def test_matches_recorded_reference(tiny_checkpoint, voice):
    recorded = json.loads(GOLDEN.read_text())["recordings"].get(weights_digest(tiny_checkpoint))
    if recorded is None:
        pytest.skip("no reference tokens recorded for this generated checkpoint (another CPU or tool "
                    "version builds other weights); record them with PERSONAPLEX_REFERENCE")
    assert len(recorded[voice]) == len(audio.split_frames(audio.read_wav(USER_WAV)))
    ours = our_tokens(tiny_checkpoint, voice, RECORDED_FRAMES)
    assert len(ours) == RECORDED_FRAMES
    assert ours == recorded[voice][:RECORDED_FRAMES]


@pytest.mark.skipif(not REFERENCE, reason="the NVIDIA/personaplex reference code is absent: set "
                    "PERSONAPLEX_REFERENCE to its moshi/ folder to run it")
@pytest.mark.parametrize("voice", VOICES)
def test_matches_reference_live(tiny_checkpoint, voice):
    assert our_tokens(tiny_checkpoint, voice) == reference_tokens(tiny_checkpoint, voice)


def record(checkpoint: Path) -> None:
    """Add (or redo) the recording of this checkpoint's digest."""
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"recordings": {}}
    golden.update(reference="NVIDIA/personaplex@3428dfd", prompt=PROMPT)
    golden["recordings"][weights_digest(checkpoint)] = {voice: reference_tokens(checkpoint, voice) for voice in VOICES}
    GOLDEN.write_text(json.dumps(golden) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"] or not REFERENCE:
        sys.exit("usage: PERSONAPLEX_REFERENCE=.../personaplex/moshi python tests/test_fidelity.py --record")
    record(HERE.parent / "checkpoints" / "tiny")
