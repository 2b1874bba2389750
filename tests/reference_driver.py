"""Runs NVIDIA/personaplex's own generation code on a checkpoint and prints its tokens.

Used by test_fidelity.py in a subprocess whose PYTHONPATH puts the reference's `moshi`
package (NVIDIA/personaplex, folder moshi/) first; nothing of the reference is vendored.

    python reference_driver.py CHECKPOINT VOICE_FILE PROMPT USER_WAV  ->  JSON [[17 ints], ...]
"""

import json
import sys

import sentencepiece
import torch
from safetensors.torch import load_file

from moshi.models.lm import LMGen, LMModel, _iterate_audio, encode_from_sphn, load_audio
from moshi.models.loaders import _lm_kwargs, get_mimi
from moshi.offline import wrap_with_system_tags


def main(checkpoint, voice_file, prompt, user_wav):
    config = json.load(open(f"{checkpoint}/config.json"))
    kwargs = {**_lm_kwargs, "dep_q": 16, **config}
    kwargs.pop("depformer_causal", None)
    lm = LMModel(device="cpu", dtype=torch.float32, **kwargs)
    lm.load_state_dict(load_file(f"{checkpoint}/model.safetensors"), strict=True)
    lm.eval()
    mimi = get_mimi(f"{checkpoint}/tokenizer-e351c8d8-checkpoint125.safetensors", "cpu")
    tokenizer = sentencepiece.SentencePieceProcessor(f"{checkpoint}/tokenizer_spm_32k_3.model")
    gen = LMGen(lm, device="cpu", use_sampling=False, audio_silence_frame_cnt=6,
                sample_rate=mimi.sample_rate, frame_rate=mimi.frame_rate)
    mimi.streaming_forever(1)
    gen.streaming_forever(1)
    if voice_file.endswith(".pt"):
        gen.load_voice_prompt_embeddings(voice_file)
    else:
        gen.load_voice_prompt(voice_file)
    gen.text_prompt_tokens = tokenizer.encode(wrap_with_system_tags(prompt)) if prompt else []
    mimi.reset_streaming()
    gen.reset_streaming()
    gen.step_system_prompts(mimi)
    mimi.reset_streaming()
    tokens = []
    frames = _iterate_audio(load_audio(user_wav, mimi.sample_rate), sample_interval_size=1920, pad=True)
    for codes in encode_from_sphn(mimi, frames, max_batch=1):
        out = gen.step(codes[:, :, 0:1])
        if out is not None:
            tokens.append(out[0, :, 0].tolist())
    print(json.dumps(tokens))


if __name__ == "__main__":
    with torch.no_grad():
        main(*sys.argv[1:5])
