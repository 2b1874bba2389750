"""What Python's garbage collector costs a talker's process, before and after what it loaded is
frozen out of the collector's walks (core/collector.py, as each Triton stub does once loaded).

In one process, as a stub has it: the serving library imported, a talker built on the
checkpoint, `--conversations` started. Then, twice, first as loaded and then after
`freeze_loaded()`: the objects the collector tracks, a full collection's wall time (median of
3), and `--seconds` of ticks over every conversation, each collection in them timed by
generation (`PauseWatch`). A collection holds the GIL: in a stub every thread waits it out.

    python -m bench.experiments.gc_pause --name gc-pause-cpu2
    python -m bench.experiments.gc_pause --checkpoint checkpoints/7b --device cuda --conversations 16 --name gc-pause-h100

writes bench/results/<date>-<name>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("NO_TORCH_COMPILE", "1")  # as served (launch.py); before moshi is imported

import torch

from bench import report, workload
from personaplex_triton.core import loaders, tunables
from personaplex_triton.core.collector import PauseWatch, freeze_loaded
from personaplex_triton.lm.sampling import SamplingParams
from personaplex_triton.mimi.runtime import open_step
from personaplex_triton.serving import serving  # noqa: F401  what a stub imports besides the talker
from personaplex_triton.stages.persona import PersonaLibrary
from personaplex_triton.stages.talker import Talker, TalkerSetup

PHASES = ("as loaded", "frozen")


def full_collection_ms(rounds: int = 3) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 2)


def tick_for(talker: Talker, conversations: int, seconds: float) -> tuple[int, dict[int, list[float]]]:
    """Ticks over every conversation for `seconds`: how many, and the collections in them (s), by generation."""
    speech = workload.frames(99)
    watch = PauseWatch()
    ticks, until = 0, time.monotonic() + seconds
    try:
        while time.monotonic() < until:
            frame = speech[ticks % len(speech)]
            talker.tick({slot: frame for slot in range(conversations)})
            ticks += 1
        return ticks, watch.take()
    finally:
        watch.close()


def phase(talker: Talker, conversations: int, seconds: float) -> dict:
    ticks, pauses = tick_for(talker, conversations, seconds)
    return {"tracked_objects": len(gc.get_objects()), "frozen_objects": gc.get_freeze_count(),
            "full_collection_ms": full_collection_ms(), "ticks": ticks,
            "collections": {str(generation): {"count": len(values), "max_ms": round(max(values) * 1000, 2),
                                              "total_ms": round(sum(values) * 1000, 1),
                                              "pauses_ms": [round(v * 1000, 3) for v in values]}
                            for generation, values in sorted(pauses.items())}}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=str(report.REPO_ROOT / "checkpoints" / "tiny"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30.0, help="of ticks in each phase")
    report.add_output_arguments(parser, "gc-pause")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(tunables.TORCH_THREADS)  # as served (serving.stage_builds.use_device_threads)
    started = report.now()
    files = loaders.resolve_checkpoint(args.checkpoint)
    tokenizer = loaders.get_tokenizer(files)
    talker = Talker(loaders.get_lm(files, args.device), open_step("encoder", files, device=args.device), tokenizer,
                    args.conversations)
    persona = PersonaLibrary(files, tokenizer).persona(workload.PERSONA.voice, workload.PERSONA.text_prompt)
    for slot in range(args.conversations):
        talker.prefill(slot, TalkerSetup(persona, SamplingParams(seed=slot)))
    phases = {PHASES[0]: phase(talker, args.conversations, args.seconds)}
    freeze_loaded()
    phases[PHASES[1]] = phase(talker, args.conversations, args.seconds)
    gc.unfreeze()
    talker.close()
    result = report.run_record("bench.experiments.gc_pause", argv, args.commit, started, checkpoint=args.checkpoint,
                               device=args.device, conversations=args.conversations, seconds=args.seconds,
                               phases=phases)
    report.save(result, args.out, f"{started:%Y-%m-%d}-{args.name}", markdown, plot)
    return 0


def markdown(result: dict, plot_name: str) -> str:
    lines = [*report.run_heading(result, "Python's garbage collector in a talker's process"),
             f"- Checkpoint {result['checkpoint']} on {result['device']}; {result['conversations']} conversations "
             f"ticking for {result['seconds']:g} s in each phase, first as loaded, then after `freeze_loaded()`.",
             "- A full collection: wall time, median of 3, after the phase's ticks. Collections in the ticks: "
             "count, longest and total (ms), by generation.", "",
             "| phase | objects tracked | frozen | full collection (ms) | ticks | generation 0 | generation 1 | generation 2 |",
             "| --- | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    for name, p in result["phases"].items():
        gens = [p["collections"].get(str(g)) for g in range(3)]
        cells = [f"{g['count']}, {g['max_ms']}, {g['total_ms']}" if g else "none" for g in gens]
        lines.append(f"| {name} | {p['tracked_objects']:,} | {p['frozen_objects']:,} | {p['full_collection_ms']} | "
                     f"{p['ticks']} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", f"![pauses]({plot_name})", ""])


def plot(result: dict, path: Path) -> None:
    report.plot_cdf({name: [v for g in p["collections"].values() for v in g["pauses_ms"]]
                     for name, p in result["phases"].items()},
                    "collection pause (ms)", "fraction of collections", "Garbage collections during ticks", path,
                    log_x=True)


if __name__ == "__main__":
    sys.exit(main())
