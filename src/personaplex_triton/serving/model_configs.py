"""The model repositories' `config.pbtxt` files, made from the wire contract.

Tensor names, types and shapes come from `contract.INPUTS` / `contract.OUTPUTS` (the ensemble,
the talker's inputs) and `seam.TENSORS` (between the stages); the model parameters, their
defaults and help from each model's config (parameters.py), which also makes the parameter
table of docs/configuration.md. There are two repositories, both served as `ensemble`:
`model_repository` (talker, code2wav, and the ensemble chaining them) and
`model_repository_one_stub` (`speech`: both stages in one Python stub, and the ensemble of it).
The committed `config.pbtxt` files are this module's output with the defaults (a test checks
it). A deployment writes its own:

    python -m personaplex_triton.serving.model_configs                  # rewrite model_repository/*/config.pbtxt, docs' table
    python -m personaplex_triton.serving.model_configs --one-stub       # rewrite model_repository_one_stub/*/config.pbtxt
    python -m personaplex_triton.serving.model_configs --check          # exit 1 where they differ from the contract
    python -m personaplex_triton.serving.model_configs --out /srv/models --gpus all \
        --set talker.max_conversations=64 --set code2wav.max_conversations=72
    python -m personaplex_triton.serving.model_configs --one-stub --out /srv/models --gpus all \
        --set speech.max_conversations=64

`--gpus all` puts one talker and one code2wav instance on every GPU Triton sees (`--gpus 0,2`:
on those); `--cpu-instances N` runs N of each on the CPU. Triton's sequence batcher gives each
conversation to one instance of each stage and keeps it there.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from ..core import contract, seam
from ..core.paths import MODEL_REPOSITORY, ONE_STUB_REPOSITORY, REPO_ROOT
from .parameters import CONFIGS, Code2WavConfig, SpeechConfig, TalkerConfig, defaults

# Each repository's models: the two stages chained by the ensemble (the default), or both stages
# in one Python stub (`speech`, serving/one_stub.py), which a frame crosses into and out of once,
# behind an ensemble of that one step. Clients see the same `ensemble` in both.
REPOSITORIES = {MODEL_REPOSITORY: ("talker", "code2wav", "ensemble"), ONE_STUB_REPOSITORY: ("speech", "ensemble")}
PBTXT_TYPES = {"FP32": "TYPE_FP32", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64", "UINT64": "TYPE_UINT64",
               "BOOL": "TYPE_BOOL", "BYTES": "TYPE_STRING"}
# A sequence that sends nothing for this long loses its place in the sequence batcher.
SEQUENCE_IDLE_US = 60_000_000
# Sequences the batcher hands a model at once. Past them Triton keeps a sequence in a backlog,
# unanswered, until a candidate ends (admitted conversations waited tens of seconds so). So more
# than any pool's slots: a model refuses conversations past its own, with an error saying so.
MAX_CANDIDATE_SEQUENCES = 1024


@dataclass(frozen=True)
class Instances:
    """Instances of each stage: `count` on the CPU, or one per GPU (`gpus` None: every GPU)."""

    kind: str = "cpu"
    count: int = 1
    gpus: tuple | None = None

    def pbtxt(self) -> str:
        if self.kind == "cpu":
            return f"instance_group [ {{ kind: KIND_CPU count: {self.count} }} ]"
        gpus = "" if self.gpus is None else f" gpus: [ {', '.join(map(str, self.gpus))} ]"
        return f"instance_group [ {{ kind: KIND_GPU count: 1{gpus} }} ]"


def _tensors(section: str, specs, as_input: bool) -> str:
    lines = []
    for spec in specs:
        optional = " optional: true" if as_input and spec.optional else ""
        dims = ", ".join(map(str, spec.dims))
        lines.append(f'  {{ name: "{spec.name}" data_type: {PBTXT_TYPES[spec.datatype]} dims: [ {dims} ]{optional} }}')
    return f"{section} [\n" + ",\n".join(lines) + "\n]"


def _parameters(parameters) -> str:
    """(key, value, help) triples as a `parameters` block, each help as a comment above its line."""
    # Each entry ends with its parameter line, so joining entries with "," puts it after that line.
    entries = ["\n".join([f"  # {line}" for line in textwrap.wrap(help, 100)]
                         + [f'  {{ key: "{key}" value: {{ string_value: "{value}" }} }}'])
               for key, value, help in parameters]
    return "parameters [\n" + ",\n".join(entries) + "\n]"


def _sequence_batching() -> str:
    # `oldest`, not `direct`: direct sends padding requests (correlation id 0) to a Python model.
    return (f"sequence_batching {{\n  max_sequence_idle_microseconds: {SEQUENCE_IDLE_US}\n"
            f"  oldest {{ max_candidate_sequences: {MAX_CANDIDATE_SEQUENCES} }}\n}}")


def _stage(name: str, header: str, inputs, outputs, instances: Instances, parameters) -> str:
    return "\n\n".join([
        header + f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\nmodel_transaction_policy {{ decoupled: true }}',
        _sequence_batching(),
        _tensors("input", inputs, True) + "\n" + _tensors("output", outputs, False),
        instances.pbtxt(),
        _parameters(parameters),
    ]) + "\n"


def talker_config(instances: Instances = Instances(), parameters=defaults(TalkerConfig)) -> str:
    header = ("# Stage 0: PersonaPlex's temporal transformer + depformer, with the Mimi encoder for the\n"
              "# user's audio. One engine per instance batches every live conversation per step.\n")
    return _stage("talker", header, contract.INPUTS, seam.TENSORS, instances, parameters)


def code2wav_config(instances: Instances = Instances(), parameters=defaults(Code2WavConfig)) -> str:
    header = ("# Stage 1: code2wav, Mimi's streaming decoder, its state kept per conversation (CONVERSATION_ID;\n"
              "# FRAME_INDEX 0 resets it, FINAL frees it), batched across conversations per tick. Under the\n"
              "# sequence batcher so that, with several instances, a conversation stays on one.\n")
    return _stage("code2wav", header, seam.TENSORS, contract.OUTPUTS, instances, parameters)


def speech_config(instances: Instances = Instances(), parameters=defaults(SpeechConfig)) -> str:
    header = ("# Both stages in one Python stub (serving/one_stub.py): one tick steps the talker, then decodes\n"
              "# its frames. The ensemble of this repository is its one step: a client's gRPC stream then\n"
              "# holds the ensemble, not this model, and Triton 2.51 can unload it at shutdown.\n")
    return _stage("speech", header, contract.INPUTS, contract.OUTPUTS, instances, parameters)


def _maps(kind: str, pairs) -> list[str]:
    return [f'      {kind} {{ key: "{key}" value: "{value}" }}' for key, value in pairs]


def ensemble_config(one_stub: bool = False) -> str:
    """The served model: the talker then code2wav, or (`one_stub`) the `speech` model alone."""
    served_in = _maps("input_map", [(s.name, s.name) for s in contract.INPUTS])
    served_out = _maps("output_map", [(s.name, s.name) for s in contract.OUTPUTS])
    if one_stub:
        steps = [['      model_name: "speech"', "      model_version: -1", *served_in, *served_out]]
    else:
        seam_names = [(spec.name, spec.name.lower()) for spec in seam.TENSORS]
        steps = [['      model_name: "talker"', "      model_version: -1", *served_in, *_maps("output_map", seam_names)],
                 ['      model_name: "code2wav"', "      model_version: -1", *_maps("input_map", seam_names), *served_out]]
    body = ",\n".join("    {\n" + "\n".join(step) + "\n    }" for step in steps)
    return ("# The served model: user audio frames in, agent audio + text out, one response per frame.\n"
            "# A conversation is a sequence (correlation id, start and end flags); the persona inputs\n"
            "# go on its start request.\n"
            f'name: "{contract.MODEL_NAME}"\nplatform: "ensemble"\nmax_batch_size: 0\n\n'
            + _tensors("input", contract.INPUTS, True) + "\n" + _tensors("output", contract.OUTPUTS, False)
            + "\n\nensemble_scheduling {\n  step [\n" + body + "\n  ]\n}\n")


def configs(instances: Instances = Instances(), overrides: dict | None = None, one_stub: bool = False) -> dict[str, str]:
    """model name -> config.pbtxt text, for the models of one repository (`one_stub`: the
    one-stub one's); `overrides` maps "model.key" to a parameter value of one of its models."""
    overrides = dict(overrides or {})
    parameters = {}
    for model in REPOSITORIES[ONE_STUB_REPOSITORY if one_stub else MODEL_REPOSITORY]:
        if model in CONFIGS:
            parameters[model] = [(key, overrides.pop(f"{model}.{key}", value), help)
                                 for key, value, help in defaults(CONFIGS[model])]
            # a value set is checked as the model will read it (ParameterError naming it)
            CONFIGS[model].from_parameters({key: value for key, value, _ in parameters[model]})
    if overrides:
        raise KeyError(f"no such model parameter: {', '.join(sorted(overrides))}")
    if one_stub:
        return {"speech": speech_config(instances, parameters["speech"]), "ensemble": ensemble_config(one_stub=True)}
    return {"talker": talker_config(instances, parameters["talker"]),
            "code2wav": code2wav_config(instances, parameters["code2wav"]),
            "ensemble": ensemble_config()}


def write(model_repository: Path, instances: Instances = Instances(), overrides: dict | None = None,
          one_stub: bool = False) -> list[Path]:
    """Writes the config.pbtxt of each model of one repository (`one_stub`: the one-stub one)
    under `model_repository`; elsewhere than this repository's own, with a copy of its model
    versions (the `1/model.py` adapters)."""
    home = ONE_STUB_REPOSITORY if one_stub else MODEL_REPOSITORY
    paths = []
    for model, text in configs(instances, overrides, one_stub).items():
        folder = model_repository / model
        if folder.resolve() != (home / model).resolve():
            shutil.copytree(home / model, folder, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "config.pbtxt"))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.pbtxt").write_text(text)
        paths.append(folder / "config.pbtxt")
    return paths


def is_one_stub(model_repository: Path) -> bool:
    """Whether a model repository is the one-stub kind (its models: `speech` and the ensemble)."""
    return (model_repository / "speech").is_dir()


DOCS = REPO_ROOT / "docs" / "configuration.md"
TABLE_BEGIN = "<!-- parameters: generated by python -m personaplex_triton.serving.model_configs -->"
TABLE_END = "<!-- end of the generated parameters -->"


def parameter_table() -> str:
    """The models' parameters as a Markdown table (docs/configuration.md), from their configs."""
    rows = ["| Parameter | Default | Models | What it does |", "|---|---|---|---|"]
    seen: dict[tuple[str, str, str], list[str]] = {}
    for model, config in CONFIGS.items():
        for entry in defaults(config):
            seen.setdefault(entry, []).append(model)
    for (key, value, help), models in seen.items():
        shown = f"`{value}`" if value else "(empty)"
        rows.append(f"| `{key}` | {shown} | {', '.join(models)} | {help.replace('|', '&#124;')} |")
    return "\n".join(rows)


def docs_with_table(text: str) -> str:
    """docs/configuration.md's text with the generated table between its markers."""
    before, begin, rest = text.partition(TABLE_BEGIN)
    _, end, after = rest.partition(TABLE_END)
    if not begin or not end:
        raise ValueError(f"{DOCS} lacks the markers {TABLE_BEGIN!r} ... {TABLE_END!r}")
    return before + TABLE_BEGIN + "\n" + parameter_table() + "\n" + TABLE_END + after


def stale(model_repository: Path | None = None) -> list[str]:
    """Models whose config.pbtxt differs from the default output: of `model_repository`, else of
    both of this repository's own (named repository/model), and the docs' parameter table."""
    if model_repository is None:
        docs = DOCS.read_text()
        return [f"{home.name}/{model}" for home in REPOSITORIES for model in stale(home)] + \
            ([] if docs_with_table(docs) == docs else ["docs/configuration.md"])
    texts = configs(one_stub=is_one_stub(model_repository))
    return [model for model, text in texts.items()
            if not (model_repository / model / "config.pbtxt").is_file()
            or (model_repository / model / "config.pbtxt").read_text() != text]


def instances_from_args(gpus: str | None, cpu_instances: int) -> Instances:
    if gpus is None:
        return Instances(count=cpu_instances)
    return Instances(kind="gpu", gpus=None if gpus == "all" else tuple(int(g) for g in gpus.split(",")))


def setting(text: str) -> tuple[str, str]:
    """One `--set MODEL.KEY=VALUE` (argparse's `type`): (MODEL.KEY, VALUE)."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set takes MODEL.KEY=VALUE, got {text!r}")
    return key, value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="model repository to write into (default: this repository's own "
                                                 "of the kind asked for)")
    parser.add_argument("--one-stub", action="store_true",
                        help="the one-stub repository (speech, and the ensemble of it) instead of talker, code2wav "
                             "and the ensemble of them")
    parser.add_argument("--check", action="store_true",
                        help="compare a model repository (default: both of this repository's own) with the output; "
                             "write nothing")
    parser.add_argument("--gpus", help='"all", or GPU indices "0,1": one instance of each stage per GPU')
    parser.add_argument("--cpu-instances", type=int, default=1, help="instances of each stage on the CPU")
    parser.add_argument("--set", action="append", default=[], type=setting, metavar="MODEL.KEY=VALUE",
                        help="a model parameter, e.g. talker.max_conversations=64")
    args = parser.parse_args(argv)
    if args.check:
        differ = stale(args.out)
        for model in differ:
            name = model if model.endswith(".md") else f"{args.out / model if args.out else model}/config.pbtxt"
            print(f"{name} differs from the contract: run python -m personaplex_triton.serving.model_configs",
                  file=sys.stderr)
        return 1 if differ else 0
    overrides = dict(args.set)
    out = args.out or (ONE_STUB_REPOSITORY if args.one_stub else MODEL_REPOSITORY)
    for path in write(out, instances_from_args(args.gpus, args.cpu_instances), overrides, args.one_stub):
        print(path)
    if args.out is None and not overrides:  # this repository's own: its docs' table too
        DOCS.write_text(docs_with_table(DOCS.read_text()))
        print(DOCS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
