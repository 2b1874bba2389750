"""The exported Mimi artefacts of a checkpoint: where they live, and whether they are current.

One folder per checkpoint, named by the hash of its Mimi weights (`build/mimi/<hash>/` in
this repository, or under $PERSONAPLEX_EXPORT_DIR), written by `make export`:

    <stage>.onnx, <stage>.onnx.json   export/export_mimi.py (stage: encoder, decoder)
    <stage>.plan, <stage>.plan.json   export/build_engine.py (on a GPU host with TensorRT)

Each JSON records the checkpoint and step-code hashes it was made from. Standard library
only: the TensorRT build container needs no torch.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from ..core.paths import MIMI_EXPORT_ROOT

EXPORT_DIR_ENV = "PERSONAPLEX_EXPORT_DIR"


@functools.lru_cache(maxsize=8)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    stat = Path(path).stat()
    return _file_sha256(str(path), stat.st_size, stat.st_mtime_ns)


def step_source_sha256() -> str:
    """Of the step definitions: an export made from other code is stale."""
    return file_sha256(Path(__file__).with_name("steps.py"))


def artefact_dir(mimi_weights: Path) -> Path:
    root = Path(os.environ.get(EXPORT_DIR_ENV) or MIMI_EXPORT_ROOT)
    return root / file_sha256(mimi_weights)[:16]


def onnx_path(mimi_weights: Path, stage: str) -> Path:
    return artefact_dir(mimi_weights) / f"{stage}.onnx"


def plan_path(mimi_weights: Path, stage: str) -> Path:
    return artefact_dir(mimi_weights) / f"{stage}.plan"


def metadata_path(artefact: Path) -> Path:
    return artefact.with_name(artefact.name + ".json")


def read_metadata(artefact: Path) -> dict | None:
    meta = metadata_path(artefact)
    return json.loads(meta.read_text()) if artefact.is_file() and meta.is_file() else None


def stale_reason(artefact: Path, mimi_weights: Path) -> str | None:
    """Why `artefact` cannot serve these weights with this code, or None if it can."""
    meta = read_metadata(artefact)
    if meta is None:
        return f"no {artefact.name} (with its .json) in {artefact.parent}: run `make export`"
    if meta.get("checkpoint_sha256") != file_sha256(mimi_weights):
        return f"{artefact} was exported from other Mimi weights"
    if meta.get("step_sha256") != step_source_sha256():
        return f"{artefact} was exported from an older mimi/steps.py: run `make export`"
    return None
