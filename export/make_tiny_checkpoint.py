#!/usr/bin/env python
"""Write a small, deterministic PersonaPlex checkpoint for development and tests.

    python export/make_tiny_checkpoint.py --out checkpoints/tiny [--seed 0] [--force]
    python export/make_tiny_checkpoint.py --size 7b --device cuda --out checkpoints/7b

`--size 7b` writes the published shape instead: PersonaPlex's 7B LM (16 depformer codebooks,
8.37 B parameters) with random bf16 weights, built on `--device` (a GPU: about 17 GB), for
measuring the real model's speed and memory; everything else is as for the small one.

The folder has exactly the layout of `nvidia/personaplex-7b-v1`, so the loader that reads the
real weights (personaplex_triton.core.loaders) reads it too:

    model.safetensors                             LM: PersonaPlex's architecture (16-codebook
                                                  depformer, same delays, vocabularies and
                                                  special tokens) at the widths of
                                                  loaders.TINY_LM_SIZE; random weights, fp32
                                                  (--size 7b: the 7B widths, bf16)
    tokenizer-e351c8d8-checkpoint125.safetensors  Mimi at full size, random weights and random
                                                  (non-zero) codebooks, fp32
    tokenizer_spm_32k_3.model                     SentencePiece trained on
                                                  export/tokenizer_corpus.txt (0 unk, 1 bos,
                                                  2 eos, 3 pad, "<system>" one piece)
    voices/NAME.wav                               copies of export/voice_prompts/*.wav
    voices/NAME.pt                                their embedding bundles (PersonaPlex's .pt
                                                  format), made by playing each WAV prompt
                                                  through the LM and Mimi above
    config.json                                   the LM width keys (loaders.LM_SIZE_KEYS)
    .generated                                    stamp: tool version, seed, input digests
                                                  (ignored by the loader)

Both safetensors files use the key names of the reference implementation (NVIDIA/personaplex,
which are those of the published files): each attention's projections are stored fused, as
`self_attn.in_proj_weight` [steps * 3 * dim, dim] and `self_attn.out_proj.weight`
[steps * dim, dim] (steps = 16 in the depformer, 1 elsewhere). PyPI moshi's modules keep them
split per step (`in_projs.{i}.weight`, `out_projs.{i}.weight`) and its load hook splits the
fused tensors back, so moshi's strict `load_state_dict` accepts these files as it accepts the
real ones.

Random-weight adjustments, all deterministic:
- LM output heads (`text_linear`, `linears.*`) are rescaled so that logits have a standard
  deviation of LOGIT_STD on random input (moshi's init gives near-uniform distributions), and
  the `text_linear` rows of ids the tiny tokenizer does not have are zeroed, so greedy or top-k
  sampling only emits decodable text ids.
- Mimi: the SEANet encoder's and decoder's conv biases are zeroed and their weights rescaled
  layer by layer to unit output std on calibration data (PyTorch's default init lets biases
  drown the signal: every input would give the same latent and every code the same audio).
  The codebooks are drawn around the encoder's latents, level by level (where a k-means init
  would place them), so real audio encodes to varied codes; the decoder's last conv is shifted
  and scaled so decoded audio has no DC offset and an RMS of DECODED_RMS.

If --out already holds a complete checkpoint with the same stamp, nothing is done (unless
--force). Output is built in a temporary folder next to --out and renamed into place.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NO_TORCH_COMPILE", "1")  # before moshi is imported

REPO_ROOT = Path(__file__).resolve().parents[1]
try:
    from personaplex_triton.core import loaders
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO_ROOT / "src"))
    from personaplex_triton.core import loaders

TOOL_VERSION = "2"
SIZES = ("tiny", "7b")
STAMP_NAME = ".generated"
DEFAULT_CORPUS = REPO_ROOT / "export" / "tokenizer_corpus.txt"
DEFAULT_VOICE_PROMPTS = REPO_ROOT / "export" / "voice_prompts"

TOKENIZER_MAX_VOCAB = 2000  # an upper bound: the corpus decides (hard_vocab_limit off)
LOGIT_STD = 3.0             # target std of the LM's text and audio logits
CODEBOOK_SPREAD = 0.25      # codebook entries' distance from the latent mean, x latent spread
DECODED_RMS = 0.1           # target RMS of Mimi's decoded audio (random codes)

_SPLIT_PROJ = re.compile(
    r"^(?P<prefix>.*\.self_attn\.)(?P<kind>in|out)_projs\.(?P<step>\d+)\.weight$")


def tiny_lm_kwargs(size: str = "tiny") -> dict:
    """PersonaPlex's LM settings at the size's widths (what loaders.lm_kwargs reads back)."""
    return {**loaders.PERSONAPLEX_LM_KWARGS, **(loaders.TINY_LM_SIZE if size == "tiny" else {})}


def to_reference_layout(state: dict) -> dict:
    """PyPI moshi's state_dict -> the reference's (published) key names.

    `X.self_attn.in_projs.{i}.weight` -> `X.self_attn.in_proj_weight` (steps concatenated on
    dim 0) and `X.self_attn.out_projs.{i}.weight` -> `X.self_attn.out_proj.weight`; all other
    keys are the same in both.
    """
    import torch

    out: dict = {}
    fused: dict[tuple[str, str], dict[int, object]] = {}
    for key, value in state.items():
        match = _SPLIT_PROJ.match(key)
        if match is None:
            out[key] = value
        else:
            fused.setdefault((match["prefix"], match["kind"]), {})[int(match["step"])] = value
    for (prefix, kind), steps in fused.items():
        if sorted(steps) != list(range(len(steps))):
            raise ValueError(f"{prefix}{kind}_projs: steps {sorted(steps)} are not 0..n-1")
        weight = torch.cat([steps[i] for i in range(len(steps))], dim=0)
        out[prefix + ("in_proj_weight" if kind == "in" else "out_proj.weight")] = weight
    return out


def _gain(value) -> float:
    """A calibration factor rounded to 3 digits, so that the last bits of a measurement
    (which can depend on the CPU and its thread count) do not reach the weights."""
    return float(f"{float(value):.3g}")


def _save_safetensors(state: dict, path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def build_lm(seed: int, text_vocab_size: int, size: str = "tiny", device: str = "cpu"):
    """PyPI moshi's LMModel with PersonaPlex's architecture at the size's widths: tiny in fp32,
    7b in bf16 (as published), on `device`."""
    import torch
    from moshi.models.lm import LMModel

    torch.manual_seed(seed)
    dtype = torch.float32 if size == "tiny" else torch.bfloat16
    lm = LMModel(device=device, dtype=dtype, **tiny_lm_kwargs(size)).eval()

    # Calibrate the output heads on random tokens so the logits are informative.
    gen = torch.Generator().manual_seed(seed)
    steps = 16
    text = torch.randint(0, text_vocab_size, (2, 1, steps), generator=gen)
    audio = torch.randint(0, lm.card, (2, lm.n_q, steps), generator=gen)
    with torch.no_grad():
        out = lm(torch.cat([text, audio], dim=1).to(device))
        text_std = out.text_logits[..., :text_vocab_size].std()  # text has no delay: no NaN
        lm.text_linear.weight.mul_(_gain(LOGIT_STD / text_std))
        lm.text_linear.weight[text_vocab_size:] = 0.0
        for k, linear in enumerate(lm.linears):
            logits = out.logits[:, k].flatten(0, 1)
            logits = logits[~logits.isnan().any(-1)]
            linear.weight.mul_(_gain(LOGIT_STD / logits.std()))
    return lm


def write_lm(out_dir: Path, seed: int, text_vocab_size: int, size: str = "tiny", device: str = "cpu") -> None:
    """model.safetensors, in the reference's key layout."""
    lm = build_lm(seed, text_vocab_size, size, device)
    _save_safetensors(to_reference_layout(lm.state_dict()), out_dir / loaders.MOSHI_NAME)


def _calibration_audio(gen, seconds: float = 4.0, rate: int = 24000):
    """A deterministic test signal: a swept, amplitude-modulated tone, noise, and a pause."""
    import torch

    t = torch.arange(int(seconds * rate), dtype=torch.float64) / rate
    sweep = torch.sin(2 * math.pi * (150.0 * t + 300.0 * t**2))
    tone = sweep * (0.6 + 0.4 * torch.sin(2 * math.pi * 3.0 * t))
    pcm = 0.1 * tone + 0.02 * torch.randn(t.shape, generator=gen, dtype=torch.float64)
    pcm[int(1.5 * rate):int(2.0 * rate)] *= 0.01
    return pcm.float().view(1, 1, -1)


def _convs(module):
    import torch

    kinds = (torch.nn.Conv1d, torch.nn.ConvTranspose1d)
    return [m for m in module.modules() if isinstance(m, kinds)]


def _normalize_convs(convs, run, target: float = 1.0) -> None:
    """Rescale each (bias-free) conv, in forward order, so its output has std `target` on
    the data that `run()` feeds: a one-pass LSUV init, done by forward hooks that scale a
    conv's weight and, equivalently, the output it hands on."""
    def hook(conv, _inputs, output):
        gain = _gain(target / output.std())
        conv.weight.mul_(gain)
        return output * gain

    handles = [conv.register_forward_hook(hook) for conv in convs]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()


def build_mimi(seed: int):
    """moshi's full-size Mimi with random weights that carry a signal, and usable codebooks."""
    import torch
    from moshi.models import loaders as moshi_loaders

    torch.manual_seed(seed)
    mimi = moshi_loaders.get_mimi(None, device="cpu", num_codebooks=8).eval()
    gen = torch.Generator().manual_seed(seed)
    audio = _calibration_audio(gen)
    encoder_convs, decoder_convs = _convs(mimi.encoder), _convs(mimi.decoder)
    with torch.no_grad():
        # PyTorch's default conv init shrinks the signal at every layer while the biases do
        # not, so random Mimi's latents and audio are constants plus a faint trace of the
        # input. Zero the SEANet biases and normalise the convs, so the input carries through.
        for conv in encoder_convs + decoder_convs:
            conv.bias.zero_()
        _normalize_convs(encoder_convs, lambda: mimi._encode_to_unquantized_latent(audio))
        latent = mimi._encode_to_unquantized_latent(audio)

        # Each split RVQ sees the same latent; within one, each level quantizes the residual
        # of the levels before. Entries: the residual's mean plus a random direction of
        # fixed length, so the nearest entry depends on the residual's direction only.
        for rvq in (mimi.quantizer.rvq_first, mimi.quantizer.rvq_rest):
            projected = rvq.input_proj(latent)
            residual = projected.transpose(1, 2).reshape(-1, projected.shape[1])
            for layer in rvq.vq.layers:
                book = layer._codebook
                mean = residual.mean(dim=0).bfloat16().float()  # rounded, as _gain()
                spread = _gain((residual - mean).norm(dim=1).pow(2).mean().sqrt())
                directions = torch.randn(book.codebook_size, book.dim, generator=gen)
                directions /= directions.norm(dim=1, keepdim=True)
                book.embedding_sum.copy_(mean + CODEBOOK_SPREAD * spread * directions)
                book.cluster_usage.fill_(1.0)
                book._initialized.fill_(1.0)
                book._embedding = None  # drop the cached embedding_sum / cluster_usage
                book._cached_initialized = False
                residual = residual - book.decode(book.encode(residual))

        # Decoder: normalise on random codes, then give the last conv the output level:
        # no DC offset (its bias), an RMS of DECODED_RMS (its weight and bias).
        codes = torch.randint(0, mimi.cardinality, (2, 8, 25), generator=gen)
        _normalize_convs(decoder_convs[:-1], lambda: mimi.decode(codes))
        pcm = mimi.decode(codes)
        last = decoder_convs[-1]
        last.bias.sub_(_gain(pcm.mean()))
        gain = _gain(DECODED_RMS / pcm.std())
        last.weight.mul_(gain)
        last.bias.mul_(gain)
    return mimi


def write_mimi(out_dir: Path, seed: int):
    """tokenizer-e351c8d8-checkpoint125.safetensors (reference key layout); returns the model."""
    mimi = build_mimi(seed)
    _save_safetensors(to_reference_layout(mimi.state_dict()), out_dir / loaders.MIMI_NAME)
    return mimi


def train_tokenizer(corpus: Path) -> bytes:
    """A SentencePiece unigram model of the corpus, deterministically (one thread, no sampling)."""
    import sentencepiece

    lines = [line.strip() for line in corpus.read_text(encoding="utf-8").splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        raise SystemExit(f"{corpus} holds no text")
    sentencepiece.set_random_generator_seed(0)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="unigram",
        vocab_size=TOKENIZER_MAX_VOCAB,
        hard_vocab_limit=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3,  # 3 is PersonaPlex's text padding token
        user_defined_symbols=[loaders.SYSTEM_TAG],
        character_coverage=1.0,
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return model.getvalue()


def write_tokenizer(out_dir: Path, corpus: Path) -> int:
    """tokenizer_spm_32k_3.model; returns its vocabulary size."""
    import sentencepiece

    proto = train_tokenizer(corpus)
    (out_dir / loaders.TOKENIZER_NAME).write_bytes(proto)
    return sentencepiece.SentencePieceProcessor(model_proto=proto).get_piece_size()


def copy_voices(out_dir: Path, voice_prompts: Path) -> list[str]:
    """voices/NAME.wav for each voice prompt WAV, copied as is."""
    voices = out_dir / loaders.VOICES_DIR
    voices.mkdir()
    wavs = sorted(voice_prompts.glob("*.wav")) if voice_prompts.is_dir() else []
    if not wavs:
        print(f"warning: no voice prompts in {voice_prompts}; voices/ is empty", file=sys.stderr)
    for wav in wavs:
        shutil.copyfile(wav, voices / wav.name)
    return [wav.stem for wav in wavs]


def write_voice_bundles(out_dir: Path, device: str = "cpu") -> float:
    """voices/NAME.pt beside each NAME.wav: PersonaPlex's embedding bundles, made by playing
    the WAV prompt through the LM and Mimi just written (so the loader is exercised too).
    Returns the seconds the loader took to read the LM."""
    import torch

    from personaplex_triton.core import loaders
    from personaplex_triton.mimi.runtime import open_step
    from personaplex_triton.stages.persona import load_voice
    from personaplex_triton.stages.talker import Talker, make_voice_bundle

    files = loaders.resolve_checkpoint(out_dir)
    # torch: the ONNX export is made from the checkpoint, after it.
    encoder = open_step("encoder", files, runtime="torch", device=device)
    started = time.monotonic()
    lm = loaders.get_lm(files, device)
    load_s = time.monotonic() - started
    talker = Talker(lm, encoder, loaders.get_tokenizer(files), 1)
    try:
        for wav in sorted(files.voices.glob("*.wav")):
            torch.save(make_voice_bundle(talker, load_voice(wav)), wav.with_suffix(".pt"))
    finally:
        talker.close()
    return load_s


def write_config(out_dir: Path, size: str = "tiny") -> None:
    """config.json: the LM width keys, as a flat object of LM kwargs (moshi's style)."""
    config = {key: tiny_lm_kwargs(size)[key] for key in loaders.LM_SIZE_KEYS}
    (out_dir / loaders.CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def expected_stamp(seed: int, corpus: Path, voice_prompts: Path, size: str = "tiny") -> dict:
    """What .generated holds: the tool version, size, seed, and digests of the input files."""
    voices = sorted(voice_prompts.glob("*.wav")) if voice_prompts.is_dir() else []
    stamp = {
        "tool": "make_tiny_checkpoint",
        "version": TOOL_VERSION,
        "seed": seed,
        "corpus_sha256": _sha256(corpus) if corpus.is_file() else None,
        "voices_sha256": {wav.name: _sha256(wav) for wav in voices},
    }
    if size != "tiny":  # the tiny checkpoint's stamp stays as it was: no needless regeneration
        stamp["size"] = size
    return stamp


def is_complete(out: Path, stamp: dict) -> bool:
    """Whether `out` is a loadable checkpoint that was generated with `stamp`."""
    try:
        if json.loads((out / STAMP_NAME).read_text()) != stamp:
            return False
        loaders.resolve_checkpoint(out)
    except (OSError, ValueError, loaders.CheckpointError):
        return False
    return (out / loaders.CONFIG_NAME).is_file()


def _make_readable(root: Path) -> None:
    """mkdtemp and safetensors create owner-only entries; give them the usual modes."""
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _install(tmp: Path, out: Path, stamp: dict) -> None:
    """Move the finished `tmp` to `out`, replacing an old `out` only once `tmp` is complete."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    try:
        os.replace(tmp, out)
    except OSError:
        if is_complete(out, stamp):  # a concurrent run got there first
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def generate(out: Path, seed: int = 0, force: bool = False, corpus: Path = DEFAULT_CORPUS,
             voice_prompts: Path = DEFAULT_VOICE_PROMPTS, size: str = "tiny", device: str = "cpu") -> dict | None:
    """Write the checkpoint to `out`; returns None when it was already up to date, else the
    seconds spent: {"lm_write_s", "lm_load_s", "total_s"}."""
    out = Path(out).absolute()
    corpus, voice_prompts = Path(corpus), Path(voice_prompts)
    stamp = expected_stamp(seed, corpus, voice_prompts, size)
    if not force and is_complete(out, stamp):
        return None
    if not corpus.is_file():
        raise SystemExit(f"tokenizer corpus {corpus} does not exist")
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as fast here (small ops) and much faster on a busy machine
    started = time.monotonic()
    try:
        vocab_size = write_tokenizer(tmp, corpus)
        write_lm(tmp, seed, vocab_size, size, device)
        lm_write_s = time.monotonic() - started
        if device != "cpu":
            torch.cuda.empty_cache()  # the generated LM is freed: the loader reads it back
        write_mimi(tmp, seed)
        copy_voices(tmp, voice_prompts)
        write_config(tmp, size)
        lm_load_s = write_voice_bundles(tmp, device)
        (tmp / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
        _make_readable(tmp)
        _install(tmp, out, stamp)
    finally:
        torch.set_num_threads(threads)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return {"lm_write_s": round(lm_write_s, 1), "lm_load_s": round(lm_load_s, 1),
            "total_s": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--force", action="store_true", help="regenerate even if up to date")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS,
                        help="tokenizer training text")
    parser.add_argument("--voice-prompts", type=Path, default=DEFAULT_VOICE_PROMPTS,
                        help="folder of voice prompt WAVs to copy")
    parser.add_argument("--size", choices=SIZES, default="tiny",
                        help="tiny (development) or 7b (the published shape, bf16: use a GPU)")
    parser.add_argument("--device", default="cpu", help="where the LM is built and the voices played")
    args = parser.parse_args(argv)

    start = time.monotonic()
    timings = generate(args.out, args.seed, args.force, args.corpus, args.voice_prompts, args.size, args.device)
    elapsed = time.monotonic() - start
    if timings is None:
        print(f"up to date, nothing to do: {args.out.absolute()} (seed {args.seed}) in {elapsed:.1f} s")
    else:
        print(f"wrote {args.out.absolute()} ({args.size}, seed {args.seed}) in {elapsed:.1f} s: LM built and "
              f"written in {timings['lm_write_s']} s, read back by the loader in {timings['lm_load_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
