"""The model's hyperparameters and checkpoint loading, in one place (as moshi's `loaders.py`);
the serving tunables are tunables.py's.

A checkpoint is a folder in the layout NVIDIA publishes for `nvidia/personaplex-7b-v1`:

    model.safetensors                               the LM (Helium temporal transformer + depformer)
    tokenizer-e351c8d8-checkpoint125.safetensors    Mimi
    tokenizer_spm_32k_3.model                       SentencePiece text tokenizer
    voices/ (or voices.tgz holding it)              voice prompts: NAME.pt bundles or NAME.wav
    config.json                                     optional; LM width keys override the 7B ones
"""

from __future__ import annotations

import json
import logging
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from . import paths

log = logging.getLogger(__name__)

MOSHI_NAME = "model.safetensors"
MIMI_NAME = "tokenizer-e351c8d8-checkpoint125.safetensors"
TOKENIZER_NAME = "tokenizer_spm_32k_3.model"
VOICES_ARCHIVE = "voices.tgz"
VOICES_DIR = "voices"
CONFIG_NAME = "config.json"
CHECKPOINT_ENV = "PERSONAPLEX_CHECKPOINT"
REQUIRED_FILES = (MOSHI_NAME, MIMI_NAME, TOKENIZER_NAME)

# PersonaPlex's LM: moshi's 7B settings with a 16-codebook depformer (it also predicts the
# user's stream). Delays: text, agent cb0..7, user cb0..7.
PERSONAPLEX_LM_KWARGS = {
    "dim": 4096,
    "text_card": 32000,
    "existing_text_padding_id": 3,
    "n_q": 16,
    "dep_q": 16,
    "card": 2048,
    "num_heads": 32,
    "num_layers": 32,
    "hidden_scale": 4.125,
    "causal": True,
    "layer_scale": None,
    "context": 3000,
    "max_period": 10000,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "depformer_dim": 1024,
    "depformer_dim_feedforward": int(4.125 * 1024),
    "depformer_num_heads": 16,
    "depformer_num_layers": 6,
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_context": 8,
    "depformer_max_period": 10000,
    "depformer_gating": "silu",
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
    "delays": [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
}
# Keys a checkpoint's config.json may set: widths and depths, never the token layout.
LM_SIZE_KEYS = (
    "dim", "num_heads", "num_layers", "hidden_scale", "context",
    "depformer_dim", "depformer_dim_feedforward", "depformer_num_heads", "depformer_num_layers",
)
# The generated development checkpoint: PersonaPlex's architecture at small widths.
TINY_LM_SIZE = {
    "dim": 256,
    "num_heads": 4,
    "num_layers": 2,
    "hidden_scale": 4.125,
    "context": 3000,
    "depformer_dim": 128,
    "depformer_dim_feedforward": int(4.125 * 128),
    "depformer_num_heads": 4,
    "depformer_num_layers": 2,
}

# Token ids and prefill constants (NVIDIA/personaplex, moshi/models/lm.py).
TEXT_PROMPT_PAD = 3          # text token forced while the voice prompt and silences play
SILENCE_TOKENS = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)  # Mimi codes of silence
SINE_TOKENS = (430, 1268, 381, 1611, 1095, 1495, 56, 472)       # user stream during prefill
PREFILL_SILENCE_FRAMES = 6   # 0.5 s of silence after the voice prompt and after the text prompt
VOICE_PROMPT_LUFS = -24.0
SYSTEM_TAG = "<system>"

# PersonaPlex's sampling defaults.
TEMPERATURE = 0.8
TEMPERATURE_TEXT = 0.7
TOP_K = 250
TOP_K_TEXT = 25


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing a file or does not match PersonaPlex's layout."""


@dataclass
class CheckpointFiles:
    root: Path
    lm_kwargs: dict = field(default_factory=dict)

    @property
    def moshi(self) -> Path:
        return self.root / MOSHI_NAME

    @property
    def mimi(self) -> Path:
        return self.root / MIMI_NAME

    @property
    def tokenizer(self) -> Path:
        return self.root / TOKENIZER_NAME

    @property
    def voices(self) -> Path:
        return self.root / VOICES_DIR

    def voice_names(self) -> list[str]:
        return sorted({p.stem for p in self.voices.iterdir() if p.suffix in (".pt", ".wav")})

    def voice_path(self, name: str) -> Path:
        """The prompt file of a voice: NAME.pt (embedding bundle), else NAME.wav; a name
        with its suffix picks that file."""
        candidates = [name] if name.endswith((".pt", ".wav")) else [f"{name}.pt", f"{name}.wav"]
        for candidate in candidates:
            path = self.voices / candidate
            if "/" not in candidate and path.is_file():
                return path
        raise CheckpointError(
            f"unknown voice {name!r}; this checkpoint has: {', '.join(self.voice_names()) or 'none'}")


def checkpoint_spec(configured: str = "") -> str:
    """The checkpoint to serve: the model config's value, else $PERSONAPLEX_CHECKPOINT, else
    the generated development checkpoint of this repository."""
    return configured or os.environ.get(CHECKPOINT_ENV) or str(paths.DEFAULT_CHECKPOINT)


def resolve_checkpoint(spec: str | os.PathLike) -> CheckpointFiles:
    """A local folder, or a Hugging Face repo id fetched where the network allows."""
    root = Path(spec)
    if not root.exists():
        if "/" not in str(spec) or str(spec).startswith((".", "/")):
            raise CheckpointError(f"checkpoint folder {str(spec)!r} does not exist")
        root = _download(str(spec))
    for name in REQUIRED_FILES:
        if not (root / name).is_file():
            raise CheckpointError(f"checkpoint {root} is missing {name}")
    if not (root / VOICES_DIR).is_dir():
        archive = root / VOICES_ARCHIVE
        if not archive.is_file():
            raise CheckpointError(f"checkpoint {root} has neither {VOICES_DIR}/ nor {VOICES_ARCHIVE}")
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(root, filter="data")
        if not (root / VOICES_DIR).is_dir():
            raise CheckpointError(f"{archive} did not contain a {VOICES_DIR}/ folder")
    return CheckpointFiles(root, lm_kwargs(root))


def lm_kwargs(root: Path) -> dict:
    kwargs = dict(PERSONAPLEX_LM_KWARGS)
    config = root / CONFIG_NAME
    if config.is_file():
        raw = json.loads(config.read_text())
        kwargs.update({k: raw[k] for k in LM_SIZE_KEYS if k in raw})
    return kwargs


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(
            repo_id, allow_patterns=[*REQUIRED_FILES, VOICES_ARCHIVE, CONFIG_NAME])
    except Exception as exc:  # offline, gated repo, unknown id
        raise CheckpointError(
            f"checkpoint {repo_id!r} is not a local folder and could not be fetched from the "
            f"Hugging Face Hub ({type(exc).__name__}: {exc})") from exc
    return Path(path)


def get_lm(files: CheckpointFiles, device="cpu", dtype=None):
    """moshi's LMModel with PersonaPlex's settings, weights loaded strictly."""
    import torch
    from moshi.models import loaders as moshi_loaders

    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    lm = moshi_loaders.get_moshi_lm(files.moshi, lm_kwargs=files.lm_kwargs, device=device, dtype=dtype)
    lm.eval()
    return lm


def get_mimi(files: CheckpointFiles, device="cpu"):
    from moshi.models import loaders as moshi_loaders

    return moshi_loaders.get_mimi(files.mimi, device=device, num_codebooks=8)


def get_tokenizer(files: CheckpointFiles):
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(str(files.tokenizer))
