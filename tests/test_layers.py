"""The library's layers (pyproject.toml's import-linter contracts) hold, and would catch an
import that runs back up, one between the independent lm and mimi, or a cycle."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from personaplex_triton.core.paths import REPO_ROOT

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(src: Path) -> subprocess.CompletedProcess:
    if not LINT_IMPORTS.exists():
        pytest.skip(f"import-linter is not installed in this venv ({LINT_IMPORTS} missing)")
    return subprocess.run([str(LINT_IMPORTS), "--config", str(REPO_ROOT / "pyproject.toml"), "--no-cache"],
                          capture_output=True, text=True, timeout=120, cwd=src,
                          env={**os.environ, "PYTHONPATH": str(src)})


def test_the_library_keeps_its_layers():
    run = lint_imports(REPO_ROOT / "src")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 kept, 0 broken" in run.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("core/audio.py", "from ..serving import launch", "personaplex_triton.core is not allowed to import personaplex_triton.serving"),
    ("mimi/stream.py", "from ..lm import kv_cache", "personaplex_triton.mimi is not allowed to import personaplex_triton.lm"),
    ("engine/outbox.py", "from . import ticker", "No cycles are allowed in personaplex_triton.engine"),
])
def test_a_wrong_import_breaks_the_contract(tmp_path, module, line, broken):
    shutil.copytree(REPO_ROOT / "src" / "personaplex_triton", tmp_path / "personaplex_triton",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "personaplex_triton" / module, "a") as f:
        f.write(f"\n{line}\n")
    run = lint_imports(tmp_path)
    assert run.returncode != 0
    assert broken in run.stdout, run.stdout
