"""What a new persona's start costs to cross to the talker's own process (`stage_process`): the
round trip of `begin_prefills` (the setups pickled on the engine's loop, sent through the pipe and
unpickled; the child only makes the job, the pieces come after). The persona's voice as served
(loaded from the checkpoint by both processes, it crosses as its file's name) against the same
voice made in memory (its tensors cross by value, as every start's did before 2026-12-06). The
two take turns; medians over the rounds. `--bundle-dim D`: the voice is a bundle of PersonaPlex's
shape for an LM of width D (4096: the 7B's, 3.6 MB), added to a copy of the checkpoint's voices
(the tiny LM cannot play it: the start fails at its first piece, after the crossing timed here).

    python -m bench.experiments.start_crossing --bundle-dim 4096 --name start-crossing-cpu2

writes bench/results/<date>-<name>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NO_TORCH_COMPILE", "1")  # as served (launch.py); before moshi is imported

from bench import report

KINDS = ("as served: by its file", "by value: its tensors")


BUNDLE = "wide-bundle.pt"
BUNDLE_FRAMES = 199  # as PersonaPlex ships its voices


def with_bundle(checkpoint: str, dim: int, folder: Path) -> str:
    """A copy of `checkpoint` in `folder` (its files linked) whose voices add a bundle of width `dim`."""
    import torch

    from personaplex_triton.core import loaders

    files = loaders.resolve_checkpoint(checkpoint)
    for path in files.root.iterdir():
        if path.name != files.voices.name:
            (folder / path.name).symlink_to(path.resolve())
    voices = folder / files.voices.name
    voices.mkdir()
    for path in files.voices.iterdir():
        (voices / path.name).symlink_to(path.resolve())
    torch.save({"embeddings": 0.02 * torch.randn(BUNDLE_FRAMES - 1, 1, 1, dim),
                "cache": torch.zeros(1, 17, loaders.PERSONAPLEX_LM_KWARGS["context"], dtype=torch.long)}, voices / BUNDLE)
    return str(folder)


def run(checkpoint: str, rounds: int, voice_name: str | None = None) -> dict:
    from personaplex_triton.lm.sampling import SamplingParams
    from personaplex_triton.serving.parameters import TalkerConfig
    from personaplex_triton.serving.serving import TalkerService
    from personaplex_triton.stages.persona import Persona, VoicePrompt
    from personaplex_triton.stages.talker import TalkerSetup

    service = TalkerService(TalkerConfig(checkpoint=checkpoint, max_conversations=2, device="cpu", warm_personas=(),
                                         stage_process=True))
    try:
        voice = service.personas.voice(voice_name)
        copy = VoicePrompt(voice.name, voice.embeddings, voice.cache, voice.frames)  # no file: crosses by value
        setups = {kind: TalkerSetup(Persona(v, ()), SamplingParams()) for kind, v in zip(KINDS, (voice, copy))}
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(rounds + 1):  # the first round unmeasured
            for kind, setup in setups.items():
                began = time.perf_counter()
                job = service.talker.begin_prefills({0: setup})
                times[kind].append((time.perf_counter() - began) * 1000)
                while not job.advance():
                    pass
                service.talker.stop(0)
        tensors = voice.frames.nbytes if voice.frames is not None else voice.embeddings.nbytes + voice.cache.nbytes
        return {"voice": voice.name, "voice_bytes": int(tensors), "rounds": rounds,
                "kinds": [{"kind": kind, "bytes": len(pickle.dumps({0: setups[kind]}, protocol=pickle.HIGHEST_PROTOCOL)),
                           "ms_p50": round(statistics.median(times[kind][1:]), 3),
                           "ms_max": round(max(times[kind][1:]), 3)} for kind in KINDS]}
    finally:
        service.close()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="", help="default: $PERSONAPLEX_CHECKPOINT, else checkpoints/tiny")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--bundle-dim", type=int, default=0, help="a voice bundle for an LM this wide (0: the checkpoint's first voice)")
    report.add_output_arguments(parser, "start-crossing")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from personaplex_triton.core.loaders import checkpoint_spec

    args, started = parse_args(argv), report.now()
    checkpoint = checkpoint_spec(args.checkpoint)
    with tempfile.TemporaryDirectory() as folder:  # the copy with the wide bundle, if one is asked for
        served = with_bundle(checkpoint, args.bundle_dim, Path(folder)) if args.bundle_dim else checkpoint
        found = run(served, args.rounds, BUNDLE if args.bundle_dim else None)
    result = report.run_record("bench.experiments.start_crossing", argv, args.commit, started, device="cpu",
                               checkpoint=report.checkpoint_label(checkpoint), **found)
    report.save(result, args.out, f"{started:%Y-%m-%d}-{args.name}", markdown, plot)
    return 0


def markdown(result: dict, plot_name: str) -> str:
    lines = [*report.run_heading(result, "A new persona's start crossing to the talker's process"),
             f"- Checkpoint {result['checkpoint']}; the talker in a process of its own (`stage_process`); voice "
             f"{result['voice']} ({result['voice_bytes']:,} bytes of tensors), no role prompt; "
             f"{result['rounds']} rounds, the two kinds taking turns, after one unmeasured.",
             "- The round trip of `begin_prefills`: the setup pickled here, through the pipe, unpickled there "
             "(the child makes the job; its pieces are not in it).", "",
             "| the voice crosses | bytes pickled | round trip p50 (ms) | max (ms) |", "| --- | ---: | ---: | ---: |"]
    for k in result["kinds"]:
        lines.append(f"| {k['kind']} | {k['bytes']:,} | {k['ms_p50']} | {k['ms_max']} |")
    return "\n".join(lines + ["", f"![crossing]({plot_name})", ""])


def plot(result: dict, path: Path) -> None:
    plt = report.pyplot()

    fig, ax = plt.subplots(figsize=(6, 3))
    kinds = result["kinds"]
    ax.barh([k["kind"] for k in kinds], [k["ms_p50"] for k in kinds])
    ax.set_xlabel("begin_prefills round trip, p50 (ms)")
    ax.grid(alpha=0.3, axis="x")
    report.save_figure(fig, path, "A start crossing to the talker's process")


if __name__ == "__main__":
    sys.exit(main())
