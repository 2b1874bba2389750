"""The generated tiny checkpoint (export/make_tiny_checkpoint.py) and the loader that reads it."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from personaplex_triton.core import audio, loaders

PUBLISHED_NAMES = {
    loaders.MOSHI_NAME, loaders.MIMI_NAME, loaders.TOKENIZER_NAME, loaders.VOICES_DIR,
    loaders.CONFIG_NAME,
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small ops: one thread is as fast, and much faster when other jobs share the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def generated(tiny_checkpoint, make_tiny, tmp_path_factory) -> Path:
    """The tool's output: tiny_checkpoint if the tool wrote it, else a fresh generation."""
    if (tiny_checkpoint / make_tiny.STAMP_NAME).is_file():
        return tiny_checkpoint
    out = tmp_path_factory.mktemp("generated") / "tiny"
    make_tiny.main(["--out", str(out)])
    return out


@pytest.fixture(scope="session")
def stamp(generated, make_tiny) -> dict:
    return json.loads((generated / make_tiny.STAMP_NAME).read_text())


@pytest.fixture(scope="session")
def default_inputs(stamp, make_tiny):
    """Skips a test that regenerates with the tool's default inputs if `generated` was not
    made from them (a PERSONAPLEX_TEST_CHECKPOINT made elsewhere)."""
    if make_tiny.expected_stamp(stamp["seed"], make_tiny.DEFAULT_CORPUS,
                                make_tiny.DEFAULT_VOICE_PROMPTS) != stamp:
        pytest.skip("the checkpoint was generated from other inputs than the tool's defaults")


@pytest.fixture(scope="session")
def files(generated):
    return loaders.resolve_checkpoint(generated)


@pytest.fixture(scope="session")
def lm(files):
    return loaders.get_lm(files)


@pytest.fixture(scope="session")
def mimi(files):
    return loaders.get_mimi(files)


@pytest.fixture(scope="session")
def tokenizer(files):
    return loaders.get_tokenizer(files)


def _random_codes(lm, vocab_size, steps=12, batch=2, seed=123):
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(0, vocab_size, (batch, 1, steps), generator=gen)
    audio = torch.randint(0, lm.card, (batch, lm.n_q, steps), generator=gen)
    return torch.cat([text, audio], dim=1)


def _keys(path):
    with safe_open(str(path), framework="pt") as f:
        return {key: (tuple(f.get_slice(key).get_shape()), f.get_slice(key).get_dtype())
                for key in f.keys()}


# Layout -------------------------------------------------------------------------------------

def test_holds_exactly_the_published_file_names(generated, make_tiny):
    names = {p.name for p in generated.iterdir()} - {make_tiny.STAMP_NAME}
    assert names == PUBLISHED_NAMES


def test_voices_are_the_prompt_wavs_and_their_bundles(generated, stamp):
    voices = generated / loaders.VOICES_DIR
    wavs = set(stamp["voices_sha256"])
    assert {p.name for p in voices.iterdir()} == wavs | {n.replace(".wav", ".pt") for n in wavs}
    for name, digest in stamp["voices_sha256"].items():
        assert name.endswith(".wav")
        assert hashlib.sha256((voices / name).read_bytes()).hexdigest() == digest
        bundle = torch.load(voices / name.replace(".wav", ".pt"), weights_only=True)
        frames = -(-audio.read_wav(voices / name).size // 1920)
        assert bundle["embeddings"].shape == (frames - 1, 1, 1, loaders.TINY_LM_SIZE["dim"])
        assert bundle["cache"].shape == (1, 17, 4)


def test_config_holds_the_tiny_lm_size(generated, files):
    config = json.loads((generated / loaders.CONFIG_NAME).read_text())
    assert config == {key: loaders.TINY_LM_SIZE[key] for key in loaders.LM_SIZE_KEYS}
    assert files.lm_kwargs == {**loaders.PERSONAPLEX_LM_KWARGS, **loaders.TINY_LM_SIZE}


def _linked_copy(src: Path, dst: Path, skip: str) -> Path:
    dst.mkdir()
    for entry in src.iterdir():
        if entry.name != skip:
            (dst / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    return dst


@pytest.mark.parametrize("missing", loaders.REQUIRED_FILES)
def test_resolve_checkpoint_names_a_missing_file(generated, tmp_path, missing):
    copy = _linked_copy(generated, tmp_path / "ckpt", skip=missing)
    loaders.resolve_checkpoint(_linked_copy(generated, tmp_path / "full", skip=""))
    with pytest.raises(loaders.CheckpointError, match=missing.replace(".", r"\.")):
        loaders.resolve_checkpoint(copy)


def test_resolve_checkpoint_names_missing_voices(generated, tmp_path):
    copy = _linked_copy(generated, tmp_path / "ckpt", skip=loaders.VOICES_DIR)
    with pytest.raises(loaders.CheckpointError, match=loaders.VOICES_DIR):
        loaders.resolve_checkpoint(copy)


def test_voices_archive_is_extracted_on_first_use(generated, tmp_path):
    """The published repository ships voices.tgz (holding voices/), not the folder."""
    import tarfile

    copy = _linked_copy(generated, tmp_path / "ckpt", skip=loaders.VOICES_DIR)
    with tarfile.open(copy / loaders.VOICES_ARCHIVE, "w:gz") as tar:
        tar.add(generated / loaders.VOICES_DIR, arcname=loaders.VOICES_DIR)
    files = loaders.resolve_checkpoint(copy)
    assert files.voice_names() == ["NATF0", "NATM0"]
    assert files.voice_path("NATF0").name == "NATF0.pt" and files.voice_path("NATF0.wav").suffix == ".wav"
    for name in ("X", "../voices/NATF0.wav"):
        with pytest.raises(loaders.CheckpointError, match="unknown voice .*NATF0, NATM0"):
            files.voice_path(name)


def test_unreachable_hub_repo_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    with pytest.raises(loaders.CheckpointError, match="nvidia/personaplex-7b-v1.*could not be fetched"):
        loaders.resolve_checkpoint("nvidia/personaplex-7b-v1")
    with pytest.raises(loaders.CheckpointError, match="does not exist"):
        loaders.resolve_checkpoint(tmp_path / "no-such-folder")


def test_safetensors_use_the_reference_key_layout(generated):
    """Fused attention projections, as NVIDIA/personaplex's modules (and the published files)."""
    lm_keys = _keys(generated / loaders.MOSHI_NAME)
    size = loaders.TINY_LM_SIZE
    dim, dep_dim, dep_q = size["dim"], size["depformer_dim"], loaders.PERSONAPLEX_LM_KWARGS["dep_q"]
    for layer in range(size["depformer_num_layers"]):
        prefix = f"depformer.layers.{layer}.self_attn."
        assert lm_keys[prefix + "in_proj_weight"][0] == (dep_q * 3 * dep_dim, dep_dim)
        assert lm_keys[prefix + "out_proj.weight"][0] == (dep_q * dep_dim, dep_dim)
    for layer in range(size["num_layers"]):
        prefix = f"transformer.layers.{layer}.self_attn."
        assert lm_keys[prefix + "in_proj_weight"][0] == (3 * dim, dim)
        assert lm_keys[prefix + "out_proj.weight"][0] == (dim, dim)
    assert lm_keys["depformer.layers.0.gating.15.linear_in.weight"][0][1] == dep_dim
    assert lm_keys["linears.15.weight"][0] == (2048, dep_dim)
    assert lm_keys["depformer_emb.14.weight"][0] == (2049, dep_dim)
    assert lm_keys["text_emb.weight"][0] == (32001, dim)
    assert lm_keys["text_linear.weight"][0] == (32000, dim)
    assert not any("in_projs" in k or "out_projs" in k or "depformer_norms" in k for k in lm_keys)
    assert {dtype for _, dtype in lm_keys.values()} == {"F32"}

    mimi_keys = _keys(generated / loaders.MIMI_NAME)
    for part in ("encoder_transformer", "decoder_transformer"):
        prefix = f"{part}.transformer.layers.7.self_attn."
        assert mimi_keys[prefix + "in_proj_weight"][0] == (1536, 512)
        assert mimi_keys[prefix + "out_proj.weight"][0] == (512, 512)
    assert not any("in_projs" in k or "out_projs" in k for k in mimi_keys)
    assert "quantizer.rvq_rest.vq.layers.30._codebook.embedding_sum" in mimi_keys


# LM -----------------------------------------------------------------------------------------

def test_lm_has_personaplex_architecture_at_tiny_widths(lm):
    kwargs = loaders.PERSONAPLEX_LM_KWARGS
    size = loaders.TINY_LM_SIZE
    assert (lm.n_q, lm.dep_q) == (16, 16)
    assert lm.delays == kwargs["delays"] == [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]
    assert (lm.card, lm.text_card, lm.existing_text_padding_id) == (2048, 32000, 3)
    assert lm.text_padding_token_id == loaders.TEXT_PROMPT_PAD
    assert lm.dim == size["dim"]
    assert len(lm.transformer.layers) == size["num_layers"]
    assert lm.transformer.layers[0].self_attn.num_heads == size["num_heads"]
    assert len(lm.depformer.layers) == size["depformer_num_layers"]
    dep_attn = lm.depformer.layers[0].self_attn
    assert dep_attn.embed_dim == size["depformer_dim"]
    assert dep_attn.num_heads == size["depformer_num_heads"]
    assert len(dep_attn.in_projs) == 16 and len(lm.depformer.layers[0].gating) == 16
    assert len(lm.linears) == len(lm.depformer_in) == 16 and len(lm.depformer_emb) == 15
    assert next(lm.parameters()).dtype == torch.float32


def test_loaded_lm_reproduces_the_saved_in_memory_model(lm, stamp, tokenizer, make_tiny):
    original = make_tiny.build_lm(stamp["seed"], tokenizer.get_piece_size())
    codes = _random_codes(lm, tokenizer.get_piece_size())
    with torch.no_grad():
        got, want = lm(codes), original(codes)
    assert torch.equal(got.text_logits, want.text_logits)
    assert torch.equal(got.logits.nan_to_num(), want.logits.nan_to_num())
    assert torch.equal(got.mask, want.mask)


def test_lm_logits_are_informative(lm, tokenizer):
    vocab = tokenizer.get_piece_size()
    with torch.no_grad():
        out = lm(_random_codes(lm, vocab, seed=7))
    audio = out.logits[~out.logits.isnan().any(-1)]
    text = out.text_logits.flatten(0, 2)
    for logits in (audio, text[:, :vocab]):
        assert torch.isfinite(logits).all()
        probs = logits.softmax(-1)
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()
        assert 1.0 < entropy < math.log(logits.shape[-1]) - 1.0  # neither flat nor one-hot
        assert logits.argmax(-1).unique().numel() > logits.shape[0] // 4  # input-dependent
    # Greedy and top-k sampling can only emit ids the tiny tokenizer can decode.
    assert (text.topk(25, dim=-1).indices < vocab).all()


def test_seed_changes_the_lm(stamp, tokenizer, make_tiny):
    vocab = tokenizer.get_piece_size()
    a = make_tiny.build_lm(stamp["seed"], vocab).state_dict()
    b = make_tiny.build_lm(stamp["seed"] + 1, vocab).state_dict()
    assert not torch.equal(a["text_emb.weight"], b["text_emb.weight"])


# Mimi ---------------------------------------------------------------------------------------

def test_mimi_codebooks_are_random_and_initialised(generated):
    with safe_open(str(generated / loaders.MIMI_NAME), framework="pt") as f:
        books = [k.rsplit(".", 1)[0] for k in f.keys() if k.endswith("._codebook.embedding_sum")]
        assert len(books) == 32
        for book in books:
            embedding = f.get_tensor(book + ".embedding_sum")
            assert embedding.shape == (2048, 256)
            assert embedding.abs().min(dim=1).values.gt(0).all()
            assert torch.unique(embedding, dim=0).shape[0] == 2048
            assert torch.equal(f.get_tensor(book + ".cluster_usage"), torch.ones(2048))
            assert f.get_tensor(book + "._initialized").item() == 1.0


def _test_signal(seconds=1.0, rate=24000):
    t = torch.arange(int(seconds * rate)) / rate
    return (0.2 * torch.sin(2 * math.pi * 330 * t) * torch.sin(2 * math.pi * 2 * t)).view(1, 1, -1)


def test_mimi_encodes_audio_to_varied_codes(mimi):
    pcm = _test_signal()
    with torch.no_grad(), mimi.streaming(1):
        codes = torch.cat([mimi.encode(pcm[..., i:i + 1920])
                           for i in range(0, pcm.shape[-1] - 1919, 1920)], dim=-1)
    assert codes.shape == (1, 8, 12)
    for k in range(8):
        assert codes[0, k].unique().numel() >= 6, codes[0, k]
    with torch.no_grad(), mimi.streaming(1):
        silence = mimi.encode(torch.zeros(1, 1, 1920 * 4))
    assert not torch.equal(silence, codes[..., :4])


def _decode_streaming(mimi, codes):
    with torch.no_grad(), mimi.streaming(1):
        return torch.cat([mimi.decode(codes[..., i:i + 1]) for i in range(codes.shape[-1])], dim=-1)


def test_mimi_decodes_codes_to_sane_varied_audio(mimi):
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 2048, (1, 8, 20), generator=gen)
    pcm = _decode_streaming(mimi, codes)
    assert pcm.shape == (1, 1, 20 * 1920)
    assert torch.isfinite(pcm).all()
    rms = pcm.pow(2).mean().sqrt().item()
    assert 0.05 < rms < 0.3
    assert pcm.abs().max() < 1.0
    assert abs(pcm.mean().item()) < 0.2 * rms  # no DC offset to speak of
    frames = pcm.view(20, 1920)
    assert frames.std(dim=1).min() > 0.01  # no constant frame
    other = _decode_streaming(mimi, torch.randint(0, 2048, (1, 8, 20), generator=gen))
    assert (pcm - other).pow(2).mean().sqrt() > 0.3 * rms  # the codes matter


# Tokenizer ----------------------------------------------------------------------------------

def test_tokenizer_special_ids_and_system_tag(tokenizer):
    ids = (tokenizer.unk_id(), tokenizer.bos_id(), tokenizer.eos_id(), tokenizer.pad_id())
    assert ids == (0, 1, 2, 3)
    assert tokenizer.pad_id() == loaders.TEXT_PROMPT_PAD
    system = tokenizer.piece_to_id(loaders.SYSTEM_TAG)
    assert system != tokenizer.unk_id()
    # One piece, after the word-boundary marker "▁" that SentencePiece puts before any text.
    marker = tokenizer.piece_to_id("▁")
    assert tokenizer.encode(loaders.SYSTEM_TAG) in ([system], [marker, system])
    assert tokenizer.encode(loaders.SYSTEM_TAG, out_type=str)[-1] == loaders.SYSTEM_TAG
    tag = loaders.SYSTEM_TAG
    ids = tokenizer.encode(f"{tag} You are a helpful assistant. {tag}")
    assert ids.count(system) == 2
    assert 100 < tokenizer.get_piece_size() <= 32000


def test_tokenizer_training_is_deterministic(generated, make_tiny, default_inputs):
    first = make_tiny.train_tokenizer(make_tiny.DEFAULT_CORPUS)
    assert make_tiny.train_tokenizer(make_tiny.DEFAULT_CORPUS) == first
    assert (generated / loaders.TOKENIZER_NAME).read_bytes() == first


# The tool -----------------------------------------------------------------------------------

def test_rerun_is_a_quick_no_op(generated, stamp, make_tiny, capsys, default_inputs):
    before = {p: p.stat().st_mtime_ns for p in generated.rglob("*")}
    start = time.monotonic()
    make_tiny.main(["--out", str(generated), "--seed", str(stamp["seed"])])
    assert time.monotonic() - start < 5.0
    assert "nothing to do" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in generated.rglob("*")} == before


def test_stale_stamp_regenerates_atomically_the_same_files(generated, stamp, make_tiny, tmp_path, default_inputs):
    """A folder whose stamp is stale is generated again, in a temporary folder that replaces it;
    the same seed gives byte-identical files."""
    out = tmp_path / "ckpt"
    shutil.copytree(generated, out)
    stamp_file = out / make_tiny.STAMP_NAME
    stamp_file.write_text(stamp_file.read_text().replace('"version": "', '"version": "old-'))
    copied = {path: path.stat().st_ino for path in out.glob("*.safetensors")}
    make_tiny.main(["--out", str(out), "--seed", str(stamp["seed"])])
    assert json.loads(stamp_file.read_text())["version"] == make_tiny.TOOL_VERSION
    assert copied and all(path.stat().st_ino != ino for path, ino in copied.items())  # written anew
    assert {p.name for p in tmp_path.iterdir()} == {"ckpt"}  # no temporary folder left behind
    for path in sorted(generated.rglob("*")):
        if path.is_file():
            twin = out / path.relative_to(generated)
            assert twin.read_bytes() == path.read_bytes(), path.name
    assert {p.relative_to(out) for p in out.rglob("*")} == {p.relative_to(generated) for p in generated.rglob("*")}
    loaders.resolve_checkpoint(out)


# The reference implementation (optional) ----------------------------------------------------

_REFERENCE_CHECK = r"""
import json, sys, torch
from safetensors.torch import load_file
from moshi.models.lm import LMModel
from moshi.models.loaders import _lm_kwargs, get_mimi
ckpt, data = sys.argv[1], torch.load(sys.argv[2])
kwargs = {**_lm_kwargs, "dep_q": 16, **json.load(open(ckpt + "/config.json"))}
lm = LMModel(device="cpu", dtype=torch.float32, **kwargs).eval()
lm.load_state_dict(load_file(ckpt + "/model.safetensors"), strict=True)
mimi = get_mimi(ckpt + "/tokenizer-e351c8d8-checkpoint125.safetensors", "cpu")
with torch.no_grad():
    out = lm.forward_train(data["codes"])
    torch.save({"logits": out.logits, "text_logits": out.text_logits,
                "pcm": mimi.decode(data["mimi_codes"])}, sys.argv[3])
"""


@pytest.mark.skipif(not os.environ.get("PERSONAPLEX_REFERENCE"),
                    reason="set PERSONAPLEX_REFERENCE to NVIDIA/personaplex's moshi/ folder")
def test_reference_implementation_loads_it_strictly(generated, lm, mimi, tokenizer, tmp_path):
    codes = _random_codes(lm, tokenizer.get_piece_size())
    mimi_codes = torch.randint(0, 2048, (1, 8, 6), generator=torch.Generator().manual_seed(0))
    torch.save({"codes": codes, "mimi_codes": mimi_codes}, tmp_path / "in.pt")
    env = {**os.environ, "PYTHONPATH": os.environ["PERSONAPLEX_REFERENCE"],
           "NO_TORCH_COMPILE": "1"}
    subprocess.run([sys.executable, "-c", _REFERENCE_CHECK, str(generated), str(tmp_path / "in.pt"),
                    str(tmp_path / "out.pt")], check=True, env=env, cwd=tmp_path)
    ref = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        out = lm(codes)
        pcm = mimi.decode(mimi_codes)
    assert torch.equal(ref["text_logits"], out.text_logits)
    assert torch.equal(ref["logits"].nan_to_num(), out.logits.nan_to_num())
    assert torch.allclose(ref["pcm"], pcm, atol=1e-6)
