"""Where this repository keeps what the library reads and writes by default (the package is
installed in editable form, so the repository is three folders above this file)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
ONE_STUB_REPOSITORY = REPO_ROOT / "model_repository_one_stub"  # `speech`: both stages in one Python stub
DEFAULT_CHECKPOINT = REPO_ROOT / "checkpoints" / "tiny"   # written by `make checkpoint`
MIMI_EXPORT_ROOT = REPO_ROOT / "build" / "mimi"           # written by `make export`
