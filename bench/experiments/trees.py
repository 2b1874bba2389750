"""Two source trees' `personaplex_triton` side by side in one process, for benchmarks that
compare them taking turns, so that a shared machine's drift falls on both."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from bench import report

THIS = "personaplex_triton"
BASE = "personaplex_triton_base"


def load_tree(src: Path, name: str):
    """The `personaplex_triton` package of the tree whose src/ is `src`, imported as `name` (its
    modules import each other relatively, so both trees live side by side)."""
    spec = importlib.util.spec_from_file_location(name, src / "personaplex_triton" / "__init__.py",
                                                  submodule_search_locations=[str(src / "personaplex_triton")])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    return package


def tree_module(package: str, layered: str):
    """`package`'s module `layered` ("stages.talker", "mimi.runtime"), or, in a --base tree
    from before the library's layers, the flat module it was ("talker", "mimi_runtime")."""
    try:
        return importlib.import_module(f"{package}.{layered}")
    except ModuleNotFoundError as exc:
        if not f"{package}.{layered}".startswith(str(exc.name)):
            raise  # a dependency of the module is missing, not the module
    layer, name = layered.split(".")
    return importlib.import_module(f"{package}.{layer}_{name}" if layer == "mimi" else f"{package}.{name}")


def packages(base: Path | None) -> dict[str, str]:
    """{label: package name} of the trees to run: a --base tree (loaded here) first, then this one."""
    if base is None:
        return {"this tree": THIS}
    load_tree(base / "src", BASE)
    return {f"base ({base})": BASE, "this tree": THIS}


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """What every two-tree benchmark takes: the checkpoint, the --base tree, where results go."""
    parser.add_argument("--checkpoint", default=str(report.REPO_ROOT / "checkpoints" / "tiny"))
    parser.add_argument("--base", type=Path, help="another source tree to compare (its src/ is used)")
    report.add_output_arguments(parser, name)
