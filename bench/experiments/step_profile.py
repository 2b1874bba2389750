"""Where one model step's time goes on a GPU: PersonaPlex's 7B shape (random bf16 weights), a pool
of conversations each 3000 frames in, `SlotGenerator.step` (token grid, temporal transformer,
depformer, sampling) under CUDA graphs at several batch sizes, and the kernels one eager step
launches (how many, and their GPU time by kernel, from torch.profiler). Run it on two source
trees in one session to compare them:

    python -m bench.experiments.step_profile --label fused --out bench/results
    PYTHONPATH=/tmp/base/src python -m bench.experiments.step_profile --label base --out bench/results
    python -m bench.experiments.step_profile --compare bench/results/step_profile-base.json bench/results/step_profile-fused.json

The first two write step_profile-LABEL.json; --compare writes step_profile.{md,png} (--name) under --out.
"""

import argparse
import json
import platform
import subprocess
from collections import defaultdict
from datetime import date
from pathlib import Path

import torch

from bench.gpu_step import age, timed

PROFILED_STEPS = 3


def step_inputs(b: int):
    from personaplex_triton.lm.generation import StepInputs

    none = torch.zeros(b, dtype=torch.bool, device="cuda")
    zeros = torch.zeros(b, 8, dtype=torch.long, device="cuda")
    return StepInputs(torch.ones(b, dtype=torch.bool, device="cuda"), torch.randint(0, 2048, (b, 8), device="cuda"),
                      zeros, none, torch.zeros(b, dtype=torch.long, device="cuda"), none)


def kernels(generator, inputs) -> dict:
    """The kernels (and copies) of one eager step: how many, their GPU time, the heaviest."""
    from torch.profiler import ProfilerActivity, profile

    generator.step(inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            generator.step(inputs)
        torch.cuda.synchronize()
    by_name = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_name[event.name][0] += 1
            by_name[event.name][1] += event.time_range.elapsed_us()
    count = sum(n for n, _ in by_name.values()) / PROFILED_STEPS
    top = sorted(by_name.items(), key=lambda item: -item[1][1])[:12]
    return {"kernels_per_step": round(count), "kernel_ms_per_step": round(sum(us for _, us in by_name.values())
                                                                          / PROFILED_STEPS / 1000, 2),
            "top": [{"kernel": name[:90], "per_step": round(n / PROFILED_STEPS, 1),
                     "ms_per_step": round(us / PROFILED_STEPS / 1000, 3)} for name, (n, us) in top]}


def profile_tree(args) -> dict:
    from moshi.models import loaders as moshi_loaders

    from personaplex_triton.core import loaders
    from personaplex_triton.lm import kv_cache
    from personaplex_triton.lm.generation import SlotGenerator
    from personaplex_triton.lm.sampling import SamplingParams

    torch.manual_seed(0)
    lm = moshi_loaders.get_moshi_lm(None, lm_kwargs=loaders.PERSONAPLEX_LM_KWARGS, device="cuda",
                                    dtype=torch.bfloat16).eval()
    generator = SlotGenerator(lm, max(args.slots), cuda_graphs=True, kv_dtype=kv_cache.KV_DTYPES[args.kv_dtype])
    for slot in range(generator.num_slots):
        generator.start(slot, SamplingParams(seed=slot))
    age(generator, args.fill)
    rows = []
    for b in args.slots:
        inputs = step_inputs(b)
        rows.append({"slots": b, "graphed_ms": timed(lambda: generator.step(inputs), args.steps)})
    # the same step's kernels, launched one by one for the profiler
    if hasattr(generator, "graphs"):
        generator.graphs.enabled = False
        generator.graphs.clear()
    else:  # a base tree from before step_graphs.py
        generator.cuda_graphs = False
        generator._graphs.clear()
    for row in rows:
        row.update(kernels(generator, step_inputs(row["slots"])))
        print({k: v for k, v in row.items() if k != "top"}, flush=True)
    generator.close()
    return {"label": args.label, "date": date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "python": platform.python_version(), "kv_dtype": args.kv_dtype,
            "fill": args.fill, "steps": args.steps, "commit": args.commit, "rows": rows}


def compare(paths: list[Path], out: Path, name: str) -> None:
    runs = [json.loads(p.read_text()) for p in paths]
    first = runs[0]
    slots = [r["slots"] for r in first["rows"]]
    cell = {(run["label"], r["slots"]): r for run in runs for r in run["rows"]}
    labels = [run["label"] for run in runs]
    lines = [f"# One model step by source tree ({first['date']}, {first['gpu']}, torch {first['torch']})", "",
             f"PersonaPlex 7B shape, random bf16 weights, {first['kv_dtype']} KV, every conversation {first['fill']} "
             f"frames in; `SlotGenerator.step` under CUDA graphs (median of {first['steps']}), and the kernels of one "
             "eager step (torch.profiler). Trees: " + ", ".join(f"{run['label']} = {run['commit']}" for run in runs)
             + ". Command: `python -m bench.experiments.step_profile` (its docstring).", "",
             "| conversations | " + " | ".join(f"{label}: step (ms) | {label}: kernels | {label}: kernel time (ms)"
                                             for label in labels)
             + (f" | {labels[-1]} / {labels[0]} step |" if len(runs) > 1 else " |"),
             "| ---: | " + " | ".join("---: | ---: | ---:" for _ in labels) + (" | ---: |" if len(runs) > 1 else " |")]
    for b in slots:
        row = [cell[(label, b)] for label in labels]
        lines.append(f"| {b} | " + " | ".join(f"{r['graphed_ms']} | {r['kernels_per_step']} | {r['kernel_ms_per_step']}"
                                              for r in row)
                     + (f" | {row[-1]['graphed_ms'] / row[0]['graphed_ms']:.2f} |" if len(runs) > 1 else " |"))
    for run in runs:
        for r in run["rows"]:
            lines += ["", f"Heaviest kernels, {run['label']}, {r['slots']} conversations (per step):", "",
                      "| kernel | launches | ms |", "| --- | ---: | ---: |"]
            lines += [f"| `{k['kernel']}` | {k['per_step']} | {k['ms_per_step']} |" for k in r["top"]]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(runs)
    for i, label in enumerate(labels):
        ax.bar([j + i * width for j in range(len(slots))], [cell[(label, b)]["graphed_ms"] for b in slots],
               width, label=label)
    ax.set(xticks=[j + width * (len(runs) - 1) / 2 for j in range(len(slots))], xticklabels=slots,
           xlabel="live conversations", ylabel="ms per model step (CUDA graphs)")
    ax.legend()
    ax.set_title(f"{first['gpu']}, {first['kv_dtype']} KV, {first['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="tree")
    parser.add_argument("--commit", default=None, help="what the tree is (default: git describe, where there is git)")
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--fill", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--compare", type=Path, nargs="+", help="step_profile-*.json to tabulate")
    parser.add_argument("--name", default="step_profile", help="--compare's file names: NAME.{md,png}")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(args.compare, args.out, args.name)
    if args.commit is None:
        args.commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                     text=True).stdout.strip() or "unknown"
    with torch.no_grad():
        report = profile_tree(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"step_profile-{args.label}.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
