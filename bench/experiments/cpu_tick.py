"""Where a CPU talker tick's time goes, and two source trees' ticks compared in one process.

One conversation of the default checkpoint (voice NATF0, the bench's role prompt, seeded
sampling) on `Talker.tick`, the user's frames from samples/user.wav, on the CPU with PyTorch's intra-op threads
as served (tunables.TORCH_THREADS). Each tick's thread CPU time, which the machine's other
users disturb less than wall time, split into the temporal transformer, the text head, the
depformer (with its sampling) and the rest (token grid, embeddings, the tick's own work); the
Mimi encode is not counted (it follows the answer). With `--base SRC`, a second tree's
`personaplex_triton` (SRC/src, loaded under another name) ticks a talker of its own on the
same weights, the two taking turns tick by tick, so that the machine's drift falls on both:

    python -m bench.experiments.cpu_tick --base /tmp/main --ticks 400 --name cpu-tick

writes bench/results/<date>-<name>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("NO_TORCH_COMPILE", "1")  # as served (launch.py); before moshi is imported

import numpy as np
import torch

from bench import report, workload
from bench.experiments import trees

PARTS = ("temporal transformer", "text head", "depformer")


class TickClock:
    """A talker of one tree, one conversation started, each tick's CPU time by part."""

    def __init__(self, package: str, checkpoint: str):
        loaders = trees.tree_module(package, "core.loaders")
        talker = trees.tree_module(package, "stages.talker")
        mimi_runtime = trees.tree_module(package, "mimi.runtime")
        persona = trees.tree_module(package, "stages.persona")
        sampling = trees.tree_module(package, "lm.sampling")
        files = loaders.resolve_checkpoint(checkpoint)
        lm = loaders.get_lm(files, "cpu", None)
        tokenizer = loaders.get_tokenizer(files)
        self.talker = talker.Talker(lm, mimi_runtime.open_step("encoder", files, "auto", "cpu"), tokenizer, 1, 1)
        setup = talker.TalkerSetup(persona.PersonaLibrary(files, tokenizer).persona(workload.PERSONA.voice, workload.PERSONA.text_prompt),
                                   sampling.SamplingParams(seed=1))
        self.talker.prefill(0, setup)
        self.ticks: list[dict] = []
        self._part: dict[str, float] = {}
        generator = self.talker.generator
        self._wrap(lm.transformer, "forward", "temporal transformer")
        self._wrap(lm.text_linear, "forward", "text head")
        if hasattr(generator, "model_step"):
            self._wrap(generator.model_step, "depformer", "depformer")
        else:  # a --base tree from before model_step.py
            self._wrap(generator, "_depformer", "depformer")

    def _wrap(self, owner, attribute: str, part: str) -> None:
        inner = getattr(owner, attribute)

        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self._part[part] = self._part.get(part, 0.0) + time.thread_time() - start

        setattr(owner, attribute, timed)

    def tick(self, frame: np.ndarray, record: bool) -> None:
        self.talker.settle()  # the last tick's encode, not counted
        self._part = {}
        start = time.thread_time()
        self.talker.tick({0: frame})
        total = time.thread_time() - start
        if record:
            ms = {part: round(self._part.get(part, 0.0) * 1000, 3) for part in PARTS}
            ms["rest"] = round(total * 1000 - sum(ms.values()), 3)
            ms["tick"] = round(total * 1000, 3)
            self.ticks.append(ms)

    def close(self) -> None:
        self.talker.close()


def summary(ticks: list[dict]) -> dict:
    return {key: round(statistics.median(t[key] for t in ticks), 2) for key in (*PARTS, "rest", "tick")}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    trees.add_arguments(parser, "cpu-tick")
    parser.add_argument("--ticks", type=int, default=400, help="ticks measured per tree (after 20 unmeasured)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # tunables.TORCH_THREADS, as serving.stage_builds.use_device_threads sets it
    clocks = {label: TickClock(package, args.checkpoint) for label, package in trees.packages(args.base).items()}
    speech = workload.frames(99)
    load = os.getloadavg()[0]
    started = report.now()
    for i in range(20 + args.ticks):
        for clock in clocks.values():
            clock.tick(speech[i % len(speech)], record=i >= 20)
    result = report.run_record("bench.experiments.cpu_tick", argv, args.commit, started,
                               load_average=[round(load, 2), round(os.getloadavg()[0], 2)],
                               trees={label: {"median_ms": summary(c.ticks), "ticks": c.ticks} for label, c in clocks.items()})
    for clock in clocks.values():
        clock.close()
    report.save(result, args.out, f"{started:%Y-%m-%d}-{args.name}", markdown, plot)
    return 0


def markdown(result: dict, plot_name: str) -> str:
    lines = [*report.run_heading(result, "A CPU talker tick, by part"),
             f"- Load average (1 min) at start {result['load_average'][0]}, at end {result['load_average'][1]}",
             "- One conversation (NATF0, the bench's role prompt, seed 1) on samples/user.wav; PyTorch at 1 "
             "intra-op thread; each tick's thread CPU time in ms, median over the ticks; the trees took turns "
             "tick by tick. The Mimi encode follows the answer and is not counted.", "",
             "| tree | ticks | temporal transformer | text head | depformer + sampling | rest | tick |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, tree in result["trees"].items():
        s = tree["median_ms"]
        lines.append(f"| {label} | {len(tree['ticks'])} | {s['temporal transformer']} | {s['text head']} | "
                     f"{s['depformer']} | {s['rest']} | {s['tick']} |")
    return "\n".join(lines + ["", f"![ticks]({plot_name})", ""])


def plot(result: dict, path: Path) -> None:
    report.plot_cdf({label: [t["tick"] for t in tree["ticks"]] for label, tree in result["trees"].items()},
                    "tick CPU time (ms)", "fraction of ticks", "CPU talker tick, one conversation", path)


if __name__ == "__main__":
    sys.exit(main())
