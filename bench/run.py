"""Benchmark a PersonaPlex Triton server: perf_analyzer, a real-time conversation load, and the
server's overhead over the library in-process. One command, on any server it can reach.

    python -m bench.run                          # starts tritonserver on the default checkpoint
    python -m bench.run --url gpu-host:8001      # an existing server (the GPU deployment)
    python -m bench.run --stages load --conversations 1 8 32 64 --seconds 10
    python -m bench.run --url gpu-host:8001 --stages load --conversations 64 --seconds 240 --persona-every 30
    python -m bench.run --url gpu-host:8001 --stages load --conversations 64 --seconds 30 --aged-context 2500
    python -m bench.run --one-stub               # starts it on model_repository_one_stub (both stages in one stub)
    python -m bench.run --stages load --conversations 8 --seconds 30 --host-noise 20/1000 --burn-cores 2 --freeze-once 200

Each load level reports the host's share: the CPU a frame of each server process on this host
(tritonserver, each stub, each stage process), of the load generator, and the host's steal. A
server the bench starts and the load generator run on disjoint cores where there are 4 or more
(--no-pin, --pin-server CPUS); the header says which cores each side ran on.

Writes <out>/<YYYY-MM-DD>-<machine>.md (tables), .json (figures) and -load.png /
-perf-analyzer.png (plots), and prints the tables. `make bench` installs what it needs first.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from personaplex_stream import stream_conversation
from personaplex_triton.core.loaders import checkpoint_spec
from personaplex_triton.core.paths import MODEL_REPOSITORY, ONE_STUB_REPOSITORY, REPO_ROOT
from personaplex_triton.core.trace import TRACE_DIR_ENV
from personaplex_triton.serving import model_configs
from personaplex_triton.serving.launch import TritonServer

from . import host_cpu, loadgen, overhead, perf_analyzer, report, stats
from .host_noise import Noise, parse_noise
from .workload import PERSONA, frames as user_frames

DEFAULT_METRICS_PORT = 8002  # tritonserver's, where --url names a server and --metrics-url does not

STAGES = ("perf-analyzer", "load", "overhead")
RESULTS = REPO_ROOT / "bench" / "results"


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="gRPC host:port of a running server; default: start one on free ports")
    parser.add_argument("--one-stub", action="store_true",
                        help="without --url: start the server on model_repository_one_stub (both stages in one "
                             "Python stub) instead of model_repository")
    parser.add_argument("--set", action="append", default=[], type=model_configs.setting, metavar="MODEL.KEY=VALUE",
                        help="without --url: a model parameter of the server it starts (on a copy of the model "
                             "repository), e.g. speech.prefill_chunk_spacing=1")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder (default bench/results)")
    parser.add_argument("--metrics-url",
                        help="with --url: that server's metrics host:port, for what each stage took at load (pool "
                             "sizes, Mimi runtimes) and the stubs' garbage collections over each load level "
                             "(default: --url's host, port 8002; 'none': not read)")
    parser.add_argument("--name", help="machine part of the file names (default: from this machine's CPU / GPU)")
    report.add_commit_argument(parser)
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--conversations", type=int, nargs="+", default=[1, 2, 4],
                        help="real-time load levels (concurrent conversations)")
    parser.add_argument("--seconds", type=float, default=4.0,
                        help="paced user audio per real-time conversation (the speech loops; 240: contexts "
                             "reach 3,000 frames, PersonaPlex's limit; 300 goes past it)")
    parser.add_argument("--aged-context", type=int, default=0, metavar="FRAMES",
                        help="real-time load: each conversation first streams FRAMES frames unpaced (a real "
                             "prefill, not measured), then the paced part; results are labelled aged")
    parser.add_argument("--pa-concurrency", type=int, nargs="+", default=[1, 2, 4],
                        help="perf_analyzer concurrency levels (sequences at once)")
    parser.add_argument("--pa-frames", type=int, default=25, help="frames per perf_analyzer sequence")
    parser.add_argument("--overhead-frames", type=int, default=25, help="frames per overhead round")
    parser.add_argument("--overhead-rounds", type=int, default=3,
                        help="in-process and Triton conversations, taking turns")
    personas = parser.add_mutually_exclusive_group()
    personas.add_argument("--new-persona", action="store_true",
                          help="real-time load: each level's last conversation brings a persona the server has not seen")
    personas.add_argument("--persona-every", type=float, metavar="SECONDS",
                          help="real-time load: the last seat of each level holds one conversation after another, "
                               "SECONDS apart, each later one with a persona the server has not seen")
    parser.add_argument("--client-processes", type=int, metavar="K",
                        help="real-time load: deal each level's conversations to K client processes, so that the "
                             "client's own GIL stays out of the latencies at many conversations (paced levels only; "
                             "default: one per 16 conversations, one for an aged level)")
    parser.add_argument("--trace-dir", type=Path,
                        help="the server's PERSONAPLEX_TRACE_DIR (it runs on this machine; a server the bench "
                             "starts gets it set): each load level's frames are followed through the stages")
    pinning = parser.add_mutually_exclusive_group()
    pinning.add_argument("--no-pin", action="store_true",
                         help="without --url: leave the server and the load generator on every core (default: "
                              f"disjoint cores where this process has at least {host_cpu.PIN_MIN_CORES})")
    pinning.add_argument("--pin-server", type=host_cpu.parse_cpus, metavar="CPUS",
                         help="without --url: the server's cores (taskset's list, e.g. 0-3), the load generator on "
                              "the others")
    parser.add_argument("--host-noise", type=_noise_argument, metavar="D/P",
                        help="real-time load, a server on this host: freeze its processes (SIGSTOP) for D ms every "
                             "P ms during each level, as a hypervisor's steal does, e.g. 20/1000")
    parser.add_argument("--burn-cores", type=int, default=0, metavar="K",
                        help="real-time load: K processes spinning a core each during each level (on the server's "
                             "cores where it is pinned)")
    parser.add_argument("--freeze-once", type=float, metavar="MS",
                        help="real-time load, a server on this host: freeze its processes once, MS ms, mid-level; "
                             "the report gives the recovery (time from the freeze's end until every frame sent "
                             "after is answered within 80 ms)")
    args = parser.parse_args(argv)
    if args.burn_cores < 0 or (args.freeze_once is not None and args.freeze_once <= 0):
        parser.error("--burn-cores must be at least 0 and --freeze-once positive")
    if args.client_processes is not None and (args.client_processes < 1 or
                                              (args.client_processes > 1 and args.aged_context)):
        parser.error(f"--client-processes must be at least 1, and 1 with --aged-context (got {args.client_processes})")
    if args.seconds <= 0 or args.aged_context < 0:
        parser.error(f"--seconds must be positive and --aged-context at least 0 (got {args.seconds:g}, "
                     f"{args.aged_context})")
    args.frames = round(args.seconds * 1000 / stats.FRAME_MS)
    try:  # a level's plan, checked before any server starts
        loadgen.plan(max(args.conversations), args.frames, args.aged_context, args.new_persona, args.persona_every)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def _noise_argument(text: str) -> tuple[float, float]:
    try:
        return parse_noise(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.command = " ".join(["python -m bench.run", *argv])
    started, clock = report.now(), time.monotonic()
    args.machine = report.machine()  # the cores this process may use, before any pinning
    if "perf-analyzer" in args.stages:
        log(f"[perf_analyzer] {perf_analyzer.check()}")  # before a server starts: fail fast
    if args.url:
        metrics_url = args.metrics_url or f"{args.url.rsplit(':', 1)[0]}:{DEFAULT_METRICS_PORT}"
        host, _, port = args.url.rpartition(":")
        server_pid = host_cpu.find_tritonserver(int(port)) if host in ("localhost", "127.0.0.1", "") else None
        if server_pid is None and (args.host_noise or args.freeze_once):
            raise SystemExit(f"--host-noise / --freeze-once: no tritonserver serving {args.url} on this host")
        return _bench(args, args.url, f"{args.url} (given with --url)", started, clock, local=False,
                      metrics_url=None if metrics_url == "none" else metrics_url,
                      server_pid=server_pid, pins=None)
    available = sorted(os.sched_getaffinity(0))
    try:
        pins = host_cpu.pin_plan(available, args.pin_server, False if args.no_pin else None)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    repository = ONE_STUB_REPOSITORY if args.one_stub else MODEL_REPOSITORY
    log(f"[server] starting tritonserver on {repository.name}" + "".join(f" --set {k}={v}" for k, v in args.set)
        + (f", on cores {pins[0]}, the load generator on {pins[1]}" if pins else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    env = {TRACE_DIR_ENV: str(args.trace_dir)} if args.trace_dir else {}
    if pins:  # the server inherits this process's cores; the load generator's come after it started
        host_cpu.pin_process(os.getpid(), pins[0])
    with tempfile.TemporaryDirectory() as copy, \
            TritonServer(_with_parameters(repository, dict(args.set), Path(copy)), env=env,
                         log_path=args.out / "tritonserver.log") as server:
        if pins:
            host_cpu.pin_process(os.getpid(), pins[1])
        log(f"[server] ready in {server.ready_s:.1f} s at {server.grpc_url}")
        where = f"started by the bench on this machine (ready in {server.ready_s:.1f} s)"
        return _bench(args, server.grpc_url, where, started, clock, local=True,
                      metrics_url=server.metrics_url,
                      server_pid=server.tritonserver_pid(), pins=pins)


def _with_parameters(repository: Path, overrides: dict[str, str], scratch: Path) -> Path:
    """`repository`, or with `overrides` ({MODEL.KEY: VALUE}) a copy of it under `scratch`."""
    if not overrides:
        return repository
    copy = scratch / repository.name
    model_configs.write(copy, overrides=overrides, one_stub=repository == ONE_STUB_REPOSITORY)
    return copy


def _bench(args, url: str, where: str, started, clock: float, local: bool, metrics_url: str | None = None,
           server_pid: int | None = None, pins: tuple[list[int], list[int]] | None = None) -> int:
    info = report.server_info(url, metrics_url)
    slots = info["talker"]["max_conversations"]  # None: auto, on a server whose metrics are not at hand
    if "perf-analyzer" in args.stages and slots is not None and max(args.pa_concurrency) > slots:
        raise SystemExit(f"--pa-concurrency {max(args.pa_concurrency)}: the server's talker has {slots} "
                         "conversation slots (max_conversations); more would be refused")
    machine = args.machine
    if local and not machine["gpus"] and info["talker"]["kv_dtype"].startswith("auto"):
        info["talker"]["kv_dtype"] = "float32 (auto: the LM's dtype on a CPU)"  # this machine's server, on its CPU
    configured = info["talker"]["checkpoint"]
    local_checkpoint = checkpoint_spec(configured)  # what this machine resolves the server's config to
    if local or configured:
        checkpoint = report.checkpoint_label(local_checkpoint)
    else:
        checkpoint = "the server's default ($PERSONAPLEX_CHECKPOINT there, else its checkpoints/tiny)"
    header = {"date": started.date().isoformat(), "started": started.strftime("%Y-%m-%d %H:%M UTC"),
              "command": args.command,
              "machine": machine, "server": where, "triton_version": info["triton_version"],
              "checkpoint": checkpoint, "talker": info["talker"], "code2wav": info["code2wav"],
              "one_stub": info["one_stub"], "one_tick": info["one_tick"], "commit": args.commit or report.git_commit(),
              "load_average_start": round(os.getloadavg()[0], 2),
              "persona": {"voice": PERSONA.voice, "text_prompt": PERSONA.text_prompt},
              "conversation_s": round(args.frames * stats.FRAME_MS / 1000, 2),
              "aged_context_frames": args.aged_context, "new_persona": args.new_persona,
              "persona_every_s": args.persona_every,
              "cores": {"pinned": pins is not None,
                        "server": host_cpu.cores_of(host_cpu.process_tree(server_pid)) if server_pid else None,
                        "load_generator": sorted(os.sched_getaffinity(0))}}
    noise = None
    if args.host_noise or args.burn_cores or args.freeze_once:
        noise = Noise(every=args.host_noise, burn_cores=args.burn_cores, freeze_once_ms=args.freeze_once,
                      burn_cpus=tuple(pins[0]) if pins and args.burn_cores else None)
        header["noise"] = noise.header()
    result = {"header": header}
    stem = result_stem(header, args.name or machine["slug"])
    title = (f"{machine['cpu']}, {machine['cores']} cores, {', '.join(machine['gpus']) or 'no GPU'}; {header['date']}; "
             f"{header['conversation_s']:g} s paced" + (f" after an aged context of {args.aged_context} frames"
                                                         if args.aged_context else ""))

    log("[warm-up] the persona's first conversation (its prefill, unless the server knows it)")
    warm = stream_conversation(user_frames(2).reshape(-1), url=url, persona=PERSONA, max_in_flight=1)
    result["first_audio_new_persona_ms"] = round(warm.first_audio_ms, 1)
    log(f"  first audio after {warm.first_audio_ms:.0f} ms")

    if "load" in args.stages:
        result["load"] = loadgen.sweep(url, args.frames, args.conversations, log, new_personas=args.new_persona,
                                       persona_every_s=args.persona_every, aged=args.aged_context, pool=slots,
                                       trace_dir=args.trace_dir, gpu_memory=report.gpu_memory_used_gib,
                                       metrics_url=metrics_url,
                                       client_processes=args.client_processes, server_pid=server_pid, noise=noise)
        result["largest_held"] = stats.largest_held(result["load"])
    if "perf-analyzer" in args.stages:
        result["perf_analyzer"] = _perf_analyzer(url, user_frames(args.pa_frames), args.pa_concurrency)
    if "overhead" in args.stages:
        result["overhead"] = overhead.compare(url, user_frames(args.overhead_frames), PERSONA, slots,
                                              info["code2wav"]["max_conversations"], local_checkpoint, log,
                                              args.overhead_rounds)
        result["overhead"]["in_process_checkpoint"] = report.checkpoint_label(local_checkpoint)
        log(f"  Triton adds {result['overhead']['overhead_ms_p50']} ms per frame (medians)")

    header["wall_s"] = round(time.monotonic() - clock, 1)
    header["load_average_end"] = round(os.getloadavg()[0], 2)
    args.out.mkdir(parents=True, exist_ok=True)
    result["plots"] = []
    if "load" in args.stages:
        report.plot_load(result["load"], f"Real-time conversations: {title}", args.out / f"{stem}-load.png")
        result["plots"].append(f"{stem}-load.png")
    if "perf-analyzer" in args.stages:
        report.plot_perf_analyzer(result["perf_analyzer"], f"perf_analyzer: {title}",
                                  args.out / f"{stem}-perf-analyzer.png")
        result["plots"].append(f"{stem}-perf-analyzer.png")
    text = report.markdown(result)
    (args.out / f"{stem}.md").write_text(text)
    report.write_load_result(result, args.out, stem)
    print(text)
    log(f"[done] {args.out / stem}.md, {report.LOAD_RESULT_SUFFIX} and plots, in {header['wall_s']} s")
    return 0


def result_stem(header: dict, name: str) -> str:
    """A result's file name, less its suffix: <date>-<name>, and -aged<FRAMES> for an aged-context
    run, so that it is never taken for conversations that long."""
    aged = header.get("aged_context_frames", 0)
    return f"{header['date']}-{name}" + (f"-aged{aged}" if aged else "")


def _perf_analyzer(url: str, frames: np.ndarray, levels: list[int]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="perf_analyzer-") as workdir:
        for c in levels:
            log(f"[perf_analyzer] concurrency {c}: {c} sequence(s) of {len(frames)} frames")
            found = perf_analyzer.run(url, c, frames, PERSONA, Path(workdir), log)
            rows.append(perf_analyzer.summary(c, found))
            r = rows[-1]
            log(f"  frame p50 {r['p50']} ms, p99 {r['p99']} ms, first response p50 {r['first_response_ms_p50']} ms")
    return rows


if __name__ == "__main__":
    sys.exit(main())
