"""How long a conversation takes to start, by persona, in one process: a persona never seen
(its prefill: a voice bundle of 199 frames, as PersonaPlex ships, and the bench's role prompt)
and one from the persona cache; then `--together N` conversations of a cached persona, as
when N clients connect at once, started one by one and in one `Talker.prefill_many` (one reset
for all). With `--base SRC`, a second tree's talker on the same weights starts the same
personas, the two taking turns, so that the machine's drift falls on both:

    python -m bench.experiments.persona_start --base /tmp/main --rounds 10 --name persona-start-cpu2
    python -m bench.experiments.persona_start --checkpoint checkpoints/7b --device cuda --name persona-start-h200

writes bench/results/<date>-<name>.{md,json,png}. Wall time of the starts (on a GPU until
their work is done), median over the rounds; the talker's slot pool is N + 1, without CUDA
graphs (a start runs none).
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
from bench.gpu_step import calls_a_tick

ONE_BY_ONE, TOGETHER = "cached, one by one", "cached, together"
LONGEST_PIECE, CACHED = "new persona, its longest piece", "cached persona"
KINDS = ("new persona", LONGEST_PIECE, CACHED, ONE_BY_ONE, TOGETHER)
VOICE_FRAMES = 199


class Starter:
    """A talker of one tree, and the starts it is timed on."""

    def __init__(self, package: str, checkpoint: str, device: str, together: int):
        loaders = trees.tree_module(package, "core.loaders")
        talker = trees.tree_module(package, "stages.talker")
        mimi_runtime = trees.tree_module(package, "mimi.runtime")
        self.persona = trees.tree_module(package, "stages.persona")
        self.sampling = trees.tree_module(package, "lm.sampling")
        files = loaders.resolve_checkpoint(checkpoint)
        lm = loaders.get_lm(files, device, None)
        self.tokenizer = loaders.get_tokenizer(files)
        # the bundle voices never run Mimi: PyTorch's encoder needs no export of either tree
        encoder = mimi_runtime.open_step("encoder", files, "torch", device)
        self.talker = talker.Talker(lm, encoder, self.tokenizer, together + 1, persona_cache_size=4,
                                    cuda_graphs=False)
        self.together = together
        self.setup = talker.TalkerSetup
        self.prompt = tuple(self.tokenizer.encode(workload.PERSONA.text_prompt))
        self.device = torch.device(device)
        self.ms: dict[str, list[float]] = {kind: [] for kind in KINDS}

    def _persona(self, voice_seed: int):
        """The persona of the voice drawn from `voice_seed`, with the bench's role prompt."""
        gen = torch.Generator().manual_seed(voice_seed)
        voice = self.persona.VoicePrompt(
            f"bench-{voice_seed}", embeddings=0.02 * torch.randn(VOICE_FRAMES, 1, 1, self.talker.lm.dim, generator=gen),
            cache=self.talker.generator.grid.cache[0].cpu().clone())
        return self.persona.Persona(voice, self.prompt)

    def start(self, voice_seed: int, kind: str) -> None:
        """Slot 0 starts the persona of `voice_seed` (a new persona: the first time); the
        together kinds start slots 1..N on it (after a start of slot 0 cached it)."""
        if kind == TOGETHER and not hasattr(self.talker, "prefill_many"):
            return  # a tree from before prefill_many
        if kind == LONGEST_PIECE:
            self._longest_piece(voice_seed)
            return
        persona = self._persona(voice_seed)
        slots = [0] if kind in KINDS[:2] else range(1, 1 + self.together)
        setups = {slot: self.setup(persona, self.sampling.SamplingParams(seed=voice_seed + slot)) for slot in slots}
        self._sync()
        started = time.perf_counter()
        if kind == TOGETHER:
            failed = self.talker.prefill_many(setups)
            assert not failed, failed
        else:
            for slot, setup in setups.items():
                self.talker.prefill(slot, setup)
        self._sync()
        self.ms[kind].append((time.perf_counter() - started) * 1000)

    def calls(self, voice_seed: int) -> dict[str, int | None]:
        """The PyTorch calls from Python (each lets a stub's other threads take the GIL) of a
        cached persona's start, alone and `together` (None: the tree has no prefill_many); the
        persona of `voice_seed` must be in the cache."""
        persona = self._persona(voice_seed)
        setup = self.setup(persona, self.sampling.SamplingParams(seed=voice_seed))
        together = {slot: setup for slot in range(1, 1 + self.together)}
        return {CACHED: calls_a_tick(lambda: self.talker.prefill(0, setup)),
                TOGETHER: calls_a_tick(lambda: self.talker.prefill_many(together))
                if hasattr(self.talker, "prefill_many") else None}

    def _longest_piece(self, voice_seed: int) -> None:
        """A new persona's start in pieces (`begin_prefills`, as the engine runs it between ticks):
        the longest piece, which is what the live conversations' frames wait for."""
        if not hasattr(self.talker, "begin_prefills"):
            return  # a tree from before starts in pieces: the whole start is one piece
        persona = self._persona(voice_seed + 500_000)  # not the "new persona" kind's, which "cached" reuses
        self._sync()
        job, longest = self.talker.begin_prefills({0: self.setup(persona, self.sampling.SamplingParams(seed=1))}), 0.0
        while True:
            began = time.perf_counter()
            done = job.advance()
            self._sync()
            longest = max(longest, time.perf_counter() - began)
            if done:
                break
        assert not job.failed, job.failed
        self.ms[LONGEST_PIECE].append(longest * 1000)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    trees.add_arguments(parser, "persona-start")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=10, help="starts of each kind per tree (after 2 unmeasured)")
    parser.add_argument("--together", type=int, default=16, help="conversations that start at once (N)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # tunables.TORCH_THREADS, as serving.stage_builds.use_device_threads sets it
    starters = {label: Starter(package, args.checkpoint, args.device, args.together)
                for label, package in trees.packages(args.base).items()}
    load = os.getloadavg()[0]
    started = report.now()
    for i in range(2 + args.rounds):
        for starter in starters.values():
            for kind in KINDS:
                starter.start(1000 + i, kind)
            if i < 2:  # warm-up
                for ms in starter.ms.values():
                    ms.clear()
    result = report.run_record(
        "bench.experiments.persona_start", argv, args.commit, started, device=args.device,
        checkpoint=report.checkpoint_label(args.checkpoint), load_average=[round(load, 2), round(os.getloadavg()[0], 2)],
        together=args.together,
        trees={label: {"median_ms": {kind: round(statistics.median(s.ms[kind]), 1) if s.ms[kind] else None
                                     for kind in KINDS}, "ms": s.ms, "calls": s.calls(1000 + args.rounds + 1)}
               for label, s in starters.items()})
    report.save(result, args.out, f"{started:%Y-%m-%d}-{args.name}", markdown, plot)
    return 0


def markdown(result: dict, plot_name: str) -> str:
    lines = [*report.run_heading(result, "A conversation's start, by persona"),
             f"- Checkpoint {result['checkpoint']} on {result['device']}",
             f"- Load average (1 min) at start {result['load_average'][0]}, at end {result['load_average'][1]}",
             f"- `Talker.start` wall time in ms, median over the rounds; new persona: its prefill ({VOICE_FRAMES}-frame "
             "voice bundle, the bench's role prompt); its longest piece: the longest of the pieces a served start "
             "runs between ticks (`begin_prefills`; n/a: the tree starts in one piece, the whole start); "
             "cached: the same persona again, from the persona cache; "
             f"{result['together']} cached, one by one or together: {result['together']} conversations of that "
             "persona starting at once, one `Talker.start` each or one `Talker.prefill_many` (n/a: the tree has none).",
             "", "| tree | rounds | new persona | new persona, its longest piece | cached persona "
             f"| {result['together']} cached, one by one | {result['together']} cached, together |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, tree in result["trees"].items():
        cells = " | ".join("n/a" if tree["median_ms"][kind] is None else str(tree["median_ms"][kind]) for kind in KINDS)
        lines.append(f"| {label} | {len(tree['ms']['new persona'])} | {cells} |")
    lines += ["", "PyTorch calls from Python of one start of the cached persona (each lets a Triton stub's other "
              "threads take the GIL), after the rounds:", "",
              f"| tree | cached persona | {result['together']} cached, together |", "| --- | ---: | ---: |"]
    for label, tree in result["trees"].items():
        calls = tree.get("calls", {})
        lines.append(f"| {label} | {calls.get(CACHED, 'n/a')} | {calls.get(TOGETHER) or 'n/a'} |")
    return "\n".join(lines + ["", f"![starts]({plot_name})", ""])


def plot(result: dict, path: Path) -> None:
    plt = report.pyplot()

    fig, axes = plt.subplots(1, len(KINDS), figsize=(4 * len(KINDS), 3.5))
    for ax, kind in zip(axes, KINDS):
        for label, tree in result["trees"].items():
            ms = sorted(tree["ms"][kind])
            ax.plot(ms, np.linspace(0, 1, len(ms)), marker=".", label=label)
        together = f"{result['together']} " if kind in (ONE_BY_ONE, TOGETHER) else ""
        ax.set_xlabel(f"{together}{kind}: start (ms)")
        ax.set_ylabel("fraction of starts")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    report.save_figure(fig, path, f"A conversation's start ({result['device']})")


if __name__ == "__main__":
    sys.exit(main())
