"""A new persona's start piece by piece, in a talker built as served, by the role prompt's length.

Served, a new persona's start runs in pieces between the live conversations' ticks
(`Talker.begin_prefills`), and its longest piece is what their frames wait for. On the H200 the
first new persona with a role prompt took 176.6 ms (its longest piece 86.0 ms) and the next
new one, of another length, 275.0 ms (126.5 ms). This bench starts, in the talker the served
one is (`TalkerService`: the pool sized from the free memory, CUDA graphs, the checkpoint's
voices played at load), personas whose role prompts take more and more tokens, each twice
without a persona cache (so each start prefills), and times each piece to the end of its GPU
work. Beside each start: the CUDA caching allocator's device allocations and retries (a retry
frees its cache and synchronises), and the Triton kernels compiled, over the start.

With `--live N`, N conversations of the default voice tick beside the start, `--spacing` ticks
before each piece as the engine's scheduler spaces them (frames of noise, no code2wav): a piece
then runs right after a tick, as served, with whatever the tick left queued on the GPU (its
Mimi encode), and the table tells the pieces' cost beside live ticks from the served one's.
With `--stage-process` the talker runs in a process of its own, as served on a GPU, and each
piece is timed as the engine's loop sees it (its round trip): beside `--live`, that tells the
process's own cost from code2wav's (served, beside it on the GPU). `--code2wav` adds that
code2wav: each live tick's answers decoded while the next piece runs (in a process of its own
too with `--stage-process`).

    python -m bench.experiments.prefill_pieces --checkpoint checkpoints/7b --device cuda --name prefill-pieces-h200
    python -m bench.experiments.prefill_pieces --checkpoint checkpoints/7b --device cuda --live 54 --kv-dtype float8_e4m3fn \
        [--stage-process] [--code2wav] --name prefill-pieces-live

writes bench/results/<date>-<name>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("NO_TORCH_COMPILE", "1")  # as served (launch.py); before moshi is imported

import numpy as np
import torch

from bench import report, stats

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()
PROMPT_WORDS = (2, 6, 10, 16, 24, 34)  # role prompts of growing length: their prefills span one to three passes


def prompt(words: int) -> str:
    return "You are " + " ".join(WORDS[i % len(WORDS)] for i in range(words)) + "."


def kernels_compiled() -> int:
    """Triton kernels compiled so far for this library's `triton.jit` functions (0 without Triton)."""
    from personaplex_triton.lm import fused_ops, ring_attention

    count = 0
    for module in (fused_ops, ring_attention):
        for value in vars(module).values():
            cache = getattr(value, "cache", None)  # triton's JITFunction: {device: {specialisation: kernel}}
            if isinstance(cache, dict):
                count += sum(len(kernels) for kernels in cache.values() if isinstance(kernels, dict))
    return count


def allocator(device: torch.device) -> tuple[int, int]:
    """(device allocations, retries) of the CUDA caching allocator so far; (0, 0) on a CPU."""
    if device.type != "cuda":
        return 0, 0
    counts = torch.cuda.memory_stats(device)
    return counts.get("num_device_alloc", 0), counts.get("num_alloc_retries", 0)


def timed_start(talker, slot: int, setup, device: torch.device, before_piece=lambda: None) -> dict:
    """Start `setup` in `slot` in pieces, each timed to the end of its GPU work;
    `before_piece()` runs before each (the live conversations' ticks), unsynchronised. A talker
    in a process of its own (`StageProcess`) times each piece's round trip, as the engine's loop
    sees it: its GPU, allocator and kernels are that process's, not read here."""
    from personaplex_triton.engine.stage_process import StageProcess
    from personaplex_triton.stages.talker import prefill_program

    if isinstance(talker, StageProcess):
        return {**timed_pieces(talker, slot, setup, lambda: None, before_piece), "positions": None, "passes": None,
                "device_allocs": None, "alloc_retries": None, "kernels_compiled": None}
    allocs, retries = allocator(device)
    kernels = kernels_compiled()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    found = timed_pieces(talker, slot, setup, sync, before_piece)
    positions = sum(step.runs_model for step in prefill_program(setup.persona, talker.lm.initial_token_id))
    allocs_after, retries_after = allocator(device)
    return {**found, "positions": positions, "passes": talker.generator.prefill.lengths(positions),
            "device_allocs": allocs_after - allocs, "alloc_retries": retries_after - retries,
            "kernels_compiled": kernels_compiled() - kernels}


def counted_pieces(talker, slot: int, setup, before_piece) -> list[int] | None:
    """The PyTorch calls from Python of each piece of `setup`'s start in `slot` (each is a
    launch, or more, from a host the server's other processes share); None for a talker in a
    process of its own."""
    from bench.gpu_step import CallCounter
    from personaplex_triton.engine.stage_process import StageProcess

    if isinstance(talker, StageProcess):
        return None

    def counted(advance) -> tuple[bool, int]:
        with CallCounter() as counter:
            done = advance()
        return done, counter.calls

    return each_piece(talker, slot, setup, before_piece, counted)


def timed_pieces(talker, slot: int, setup, sync, before_piece) -> dict:
    """`setup`'s start in `slot`, each piece timed to `sync()` after it; the slot stopped after."""

    def timed(advance) -> tuple[bool, float]:
        began = time.perf_counter()
        done = advance()
        sync()
        return done, round((time.perf_counter() - began) * 1000, 1)

    sync()  # what was queued before the start is not its first piece's
    pieces = each_piece(talker, slot, setup, before_piece, timed)
    return {"prompt_tokens": len(setup.persona.text_tokens), "pieces_ms": pieces, "ms": round(sum(pieces), 1),
            "longest_ms": max(pieces)}


def each_piece(talker, slot: int, setup, before_piece, measure) -> list:
    """`setup`'s start in `slot`, piece by piece: `before_piece()` before each, and of each what
    `measure(advance)` gives ((done, figure)); the slot stopped after."""
    job, figures, done = talker.begin_prefills({slot: setup}), [], False
    while not done:
        before_piece()
        done, figure = measure(job.advance)
        figures.append(figure)
    if job.failed:
        raise RuntimeError(f"the start failed: {job.failed}")
    talker.stop(slot)
    return figures


class LiveTicks:
    """`live` conversations of `persona` in the slots after 0, ticked `spacing` times a call,
    each tick timed (it ends when its answers are on the host, as served). With a `decoder`
    (code2wav), each tick's answers are decoded on a thread of their own while what follows
    runs, as code2wav's engine decodes them served, its GPU work beside the talker's."""

    def __init__(self, talker, persona, live: int, spacing: int, decoder=None):
        from personaplex_triton.lm.sampling import SamplingParams
        from personaplex_triton.stages.talker import TalkerSetup

        if live >= talker.num_slots:
            raise ValueError(f"--live {live}: the talker's pool has {talker.num_slots} slots, and slot 0 is the starts'")
        self.talker, self.spacing, self.ticks_ms = talker, spacing, []
        slots = range(1, live + 1)
        failed = talker.prefill_many({s: TalkerSetup(persona, SamplingParams()) for s in slots})
        if failed:
            raise RuntimeError(f"the live conversations did not start: {failed}")
        noise = np.random.default_rng(0).normal(0, 0.01, (live, 1920)).astype(np.float32)
        self.frames = dict(zip(slots, noise))
        self.decoder, self.decodes_ms, self._decoding = decoder, [], None
        if decoder is not None:
            failed = decoder.prefill_many({s: None for s in slots})
            if failed:
                raise RuntimeError(f"the live conversations' decoder did not start: {failed}")
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="code2wav")

    def __call__(self) -> None:
        for _ in range(self.spacing if self.frames else 0):
            began = time.perf_counter()
            answers = self.talker.tick(self.frames)
            self.ticks_ms.append((time.perf_counter() - began) * 1000)
            if self.decoder is not None and answers:
                self.wait()  # code2wav's tick is shorter than the talker's: rarely waited for
                self._decoding = self._pool.submit(self._decode, answers)

    def _decode(self, answers: dict) -> None:
        from personaplex_triton.stages.code2wav import CodesFrame

        began = time.perf_counter()
        self.decoder.tick({slot: CodesFrame(step.codes) for slot, step in answers.items()})
        self.decodes_ms.append((time.perf_counter() - began) * 1000)

    def wait(self) -> None:
        """The last decode done (its error raised here)."""
        if self._decoding is not None:
            self._decoding.result()
            self._decoding = None

    def close(self) -> None:
        if self.decoder is not None:
            self._pool.shutdown(wait=True)


def run(checkpoint: str, device: str, max_conversations: str, live: int = 0, spacing: int = 1,
        stage_process: bool = False, kv_dtype: str = "auto", code2wav: bool = False) -> tuple[list[dict], str, dict]:
    from personaplex_triton.core.metrics import Metrics
    from personaplex_triton.lm.sampling import SamplingParams
    from personaplex_triton.serving.parameters import Code2WavConfig, TalkerConfig
    from personaplex_triton.serving.serving import TalkerService
    from personaplex_triton.serving.stage_builds import build_code2wav, open_stage
    from personaplex_triton.stages.talker import TalkerSetup

    with contextlib.ExitStack() as closing:  # closed in reverse: the ticks' thread, the talker, code2wav
        decoder = None
        if code2wav:  # first, as served: on a GPU it takes its largest tick's memory before the talker sizes its pool
            decoder = open_stage("code2wav", build_code2wav, Code2WavConfig(
                checkpoint=checkpoint, device=device, stage_process=stage_process).resolved(), Metrics())[0]
            closing.callback(getattr(decoder, "close", lambda: None))
        # No persona cache: every start prefills, the same persona's second start too (the voices
        # are still played once at load, as served, which warms what an empty role prompt runs).
        service = TalkerService(TalkerConfig.from_parameters(dict(
            checkpoint=checkpoint, max_conversations=max_conversations, device=device, persona_cache_size="0",
            warm_personas="all", stage_process=str(stage_process).lower(), kv_dtype=kv_dtype)))
        closing.callback(service.close)
        voice = service.personas.default_voice
        ticks = LiveTicks(service.talker, service.personas.persona(voice, ""), live, spacing, decoder)
        closing.callback(ticks.close)
        starts = []
        for words in PROMPT_WORDS:
            persona = service.personas.persona(voice, prompt(words))
            for turn in (1, 2):
                start = timed_start(service.talker, 0, TalkerSetup(persona, SamplingParams()), torch.device(device),
                                    before_piece=ticks)
                starts.append({"words": words, "voice": voice, "turn": turn, **start})
            calls = counted_pieces(service.talker, 0, TalkerSetup(persona, SamplingParams()), ticks)
            for start in starts[-2:]:
                start["calls"] = calls
        ticks.wait()
        return starts, service.info.slots_why, {
            "live": live, "spacing": spacing, "ticks": len(ticks.ticks_ms),
            "tick_ms_p50": stats.percentiles(ticks.ticks_ms, (50,))["p50"],
            "code2wav": code2wav, "decodes": len(ticks.decodes_ms),
            "decode_ms_p50": stats.percentiles(ticks.decodes_ms, (50,))["p50"]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="", help="default: $PERSONAPLEX_CHECKPOINT, else checkpoints/tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-conversations", default="auto", help="the talker's pool, as its config parameter")
    parser.add_argument("--kv-dtype", default="auto",
                        help="the talker's KV cache, as its config parameter (float8_e4m3fn: an H100 pools 55)")
    parser.add_argument("--live", type=int, default=0, help="conversations ticking beside the starts")
    parser.add_argument("--stage-process", action="store_true",
                        help="the talker in a process of its own, as served on a GPU: each piece's round trip")
    parser.add_argument("--code2wav", action="store_true",
                        help="with --live: a code2wav decoding each live tick's answers beside what follows, as "
                             "served (in a process of its own with --stage-process)")
    parser.add_argument("--spacing", type=int, default=None,
                        help="their ticks before each piece (default: the served scheduler's, tunables.PREFILL_CHUNK_SPACING_TICKS)")
    report.add_output_arguments(parser, "prefill-pieces")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    from personaplex_triton.core import loaders, tunables

    args = parse_args(argv)
    started = report.now()
    checkpoint = loaders.checkpoint_spec(args.checkpoint)
    spacing = tunables.PREFILL_CHUNK_SPACING_TICKS if args.spacing is None else args.spacing
    if args.code2wav and not args.live:
        raise SystemExit("--code2wav decodes the live conversations' answers: give --live N too")
    starts, pool, live = run(checkpoint, args.device, args.max_conversations, args.live, spacing,
                             args.stage_process, args.kv_dtype, args.code2wav)
    result = report.run_record("bench.experiments.prefill_pieces", argv, args.commit, started, device=args.device,
                               checkpoint=report.checkpoint_label(checkpoint), kv_dtype=args.kv_dtype, pool=pool, live=live,
                               stage_process=args.stage_process, starts=starts)
    report.save(result, args.out, f"{started:%Y-%m-%d}-{args.name}", markdown, plot)
    return 0


def markdown(result: dict, plot_name: str) -> str:
    lines = [*report.run_heading(result, "A new persona's start, piece by piece"),
             f"- Checkpoint {result['checkpoint']} on {result['device']}; the talker as served: {result['pool']}",
             "- Each persona started twice, with no persona cache (each start prefills), in the order of the "
             "table, then a third time to count each piece's PyTorch calls from Python (each a launch or more, "
             "from a host the server's other processes share; not timed: the counting slows them). "
             "Pieces: wall time of each `PrefillJob.advance`, to the end of its GPU work (ms); "
             "passes: the prefill's transformer passes (positions each); allocations and retries: the CUDA "
             "caching allocator's over the start; kernels: Triton kernels compiled over the start.",
             *live_line(result.get("live")),
             *(["- The talker in a process of its own (`--stage-process`, as served on a GPU): each piece is "
                "its round trip as the engine's loop sees it, its GPU work not waited for; the columns that "
                "process alone knows are '-'."] if result.get("stage_process") else []), "",
             "| prompt tokens | prefill positions | passes | start | pieces (ms) | whole (ms) | longest (ms) "
             "| PyTorch calls a piece | device allocations | allocator retries | kernels compiled |",
             "| ---: | ---: | --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for s in result["starts"]:
        lines.append(f"| {s['prompt_tokens']} | {report.cell(s['positions'])} | {report.cells(s['passes'])} | "
                     f"{'first' if s['turn'] == 1 else 'second'} | {report.cells(s['pieces_ms'])} | {s['ms']} | "
                     f"{s['longest_ms']} | {report.cells(s.get('calls'))} | {report.cell(s['device_allocs'])} | {report.cell(s['alloc_retries'])} | "
                     f"{report.cell(s['kernels_compiled'])} |")
    return "\n".join(lines + ["", f"![pieces]({plot_name})", ""])


def live_line(live: dict | None) -> list[str]:
    if not live or not live["live"]:
        return ["- No live conversations: the pieces ran back to back."]
    decoded = (f"a code2wav decoding each tick's answers while what follows runs, as served "
               f"({live['decodes']} decodes, p50 {live['decode_ms_p50']} ms)" if live.get("code2wav") else "no code2wav")
    return [f"- Beside {live['live']} live conversations: {live['spacing']} of their ticks before each piece "
            f"(frames of noise; {decoded}), the piece timed from the tick's end; {live['ticks']} ticks, "
            f"p50 {live['tick_ms_p50']} ms."]


def plot(result: dict, path: Path) -> None:
    plt = report.pyplot()

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for turn, marker in ((1, "o"), (2, "x")):
        starts = [s for s in result["starts"] if s["turn"] == turn]
        ax.plot([s["prompt_tokens"] for s in starts], [s["longest_ms"] for s in starts], marker=marker,
                label=f"longest piece, {'first' if turn == 1 else 'second'} start of the length")
    ax.set_xlabel("role prompt (tokens)")
    ax.set_ylabel("ms")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    report.save_figure(fig, path, f"A new persona's start, piece by piece ({result['device']})")


if __name__ == "__main__":
    sys.exit(main())
