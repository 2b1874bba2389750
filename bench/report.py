"""What a run states about itself (machine, server, checkpoint, Mimi runtime, commit, date), and
its results as a Markdown table file, JSON and PNG plots."""

from __future__ import annotations

import json
import lzma
import os
import platform
import re
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import tritonclient.grpc as grpcclient

from personaplex_triton.core.metrics import stage_setups
from personaplex_triton.core.paths import REPO_ROOT
from personaplex_triton.mimi.artefacts import file_sha256

from . import stats
from .loadgen import LOAD_GENERATOR, LONG_PAUSE_S, NEW_PERSONA_AFTER_S


def machine() -> dict:
    """This machine: CPU model, cores this process may use, GPUs (nvidia-smi), and a short slug."""
    cpu = platform.processor() or platform.machine()
    try:
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = names[0].strip() if names else cpu
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0))
    gpus = []
    if shutil.which("nvidia-smi"):
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                capture_output=True, text=True)
        gpus = [line.strip() for line in listed.stdout.splitlines() if line.strip()]
    if gpus:
        slug = f"{len(gpus)}x-{gpus[0]}"
    else:
        slug = f"cpu{cores}-{cpu}"
    slug = re.sub(r"[^a-z0-9]+", "-", slug.lower()).strip("-")
    return {"cpu": cpu, "cores": cores, "gpus": gpus, "slug": slug}


def server_info(url: str, metrics_url: str | None = None) -> dict:
    """What the server says of itself: Triton version, whether it runs both stages in one stub
    (`one_stub`: the `speech` model of model_repository_one_stub, whose one engine's tick steps both:
    `one_tick`), and per stage its config parameters (pool size, checkpoint, device,
    `mimi_runtime`; the talker's KV dtype), from the stage's model or from `speech`. With its
    metrics at hand (`metrics_url`, core/metrics.stage_setups), what each stage took at load: its
    pool, its send threads, the Mimi runtime it runs ("auto: onnxruntime") and the talker's KV dtype."""
    client = grpcclient.InferenceServerClient(url=url)
    setups = stage_setups(metrics_url, expect=("talker", "code2wav")) if metrics_url is not None else {}
    try:
        one_stub = params_of(client, "speech") if client.is_model_ready("speech") else None
        info = {"triton_version": client.get_server_metadata().version, "one_stub": one_stub is not None,
                "one_tick": one_stub is not None}
        for model in ("talker", "code2wav"):
            params = params_of(client, model) if one_stub is None else one_stub
            runtime = params.get("mimi_runtime", "")
            configured = params.get("code2wav_conversations" if one_stub and model == "code2wav" else "max_conversations", "")
            setup = setups.get(model)
            # auto: what the stage took, where its metrics are at hand; else unknown (None)
            info[model] = {"max_conversations": setup.slots if setup else int(configured) if configured.isdigit() else None,
                           "checkpoint": params.get("checkpoint", ""), "device": params.get("device", ""),
                           "mimi_runtime": f"{runtime}: {setup.mimi_runtime}" if setup else runtime,
                           "send_threads": setup.send_threads if setup else None}
            if model == "talker":
                info[model]["kv_dtype"] = setup.kv_dtype if setup and setup.kv_dtype else kv_dtype(params)
    finally:
        client.close()
    return info


def params_of(client, model: str) -> dict[str, str]:
    """A model's config parameters, {key: string value}, as the server has them."""
    config = client.get_model_config(model, as_json=True)["config"]
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


def kv_dtype(params: dict[str, str]) -> str:
    """What the talker's KV cache stores, where its metrics do not say: its `kv_dtype` parameter;
    for auto, its `dtype` parameter (auto's KV is the LM's dtype); else the auto rule itself."""
    for key in ("kv_dtype", "dtype"):
        if params.get(key, "") not in ("", "auto"):
            return params[key]
    return "auto: the LM's dtype (bfloat16 on a GPU, float32 on a CPU)"


def gpu_memory_used_gib() -> float | None:
    """GPU memory in use on this machine (all GPUs, every process), from nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return round(sum(float(v) for v in out.split()) / 1024, 1)


def checkpoint_label(spec: str) -> str:
    """A checkpoint folder as its path and the start of its LM weights' SHA-256; a hub name as is."""
    weights = Path(spec) / "model.safetensors"
    if not weights.is_file():
        return spec
    return f"{spec} (model.safetensors sha256 {file_sha256(weights)[:12]})"


def add_output_arguments(parser, name: str) -> None:
    """A benchmark's `--out` (the results folder), `--name` (the files' stem after the date) and `--commit`."""
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--name", default=name)
    add_commit_argument(parser)


def add_commit_argument(parser) -> None:
    parser.add_argument("--commit", help="what the tree is (default: git's HEAD here; a copy whose history is stale, "
                                         "as the GPU host's is, needs it said)")


def git_commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + (" (uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")


def now() -> datetime:
    return datetime.now(timezone.utc)


def run_record(module: str, argv, commit: str | None, started: datetime, **fields) -> dict:
    """The head of a one-process bench's result: its command line (`argv`, None: this
    process's), this machine, the tree (`commit`, None: git's), when it started; then `fields`."""
    return {"command": f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": machine(), "commit": commit or git_commit(), "started": started.isoformat(timespec="seconds"),
            **fields}


def run_heading(result: dict, title: str) -> list[str]:
    """The first lines of such a result's markdown: `title` with the date and the machine, the
    command, the commit."""
    m = result["machine"]
    gpus = f", {', '.join(m['gpus'])}" if m["gpus"] else ""
    return [f"# {title} ({result['started'][:10]}, {m['cpu']}, {m['cores']} cores{gpus})", "",
            f"- Command: `{result['command']}`", f"- Commit {result['commit']}, started {result['started']} UTC"]


def dumps(result: dict) -> str:
    """`result` as indented JSON, with every list of numbers on one line (a level keeps every
    frame's latency: one number a line would be hundreds of thousands of lines)."""
    text = json.dumps(result, indent=1)
    # Only indentation puts a raw newline in JSON (strings escape theirs), so this touches no string.
    return re.sub(r"\[\n[-0-9.eE+,\s]*\]", lambda m: re.sub(r"\s+", "", m.group()), text) + "\n"


# A load result keeps every frame's latency: about 1 MB of JSON a 4-minute level, a fifth of it
# compressed. The checkout travels to the lent GPU beside the server's wheels, 64 MiB a call.
LOAD_RESULT_SUFFIX = ".json.xz"


def write_load_result(result: dict, out: Path, stem: str) -> Path:
    """`result` (bench.run's) as out/stem.json.xz: `dumps`' JSON, xz-compressed
    (`xz -dk FILE` gives the JSON)."""
    path = out / f"{stem}{LOAD_RESULT_SUFFIX}"
    path.write_bytes(lzma.compress(dumps(result).encode()))
    return path


def read_result(path: Path) -> dict:
    """A result's JSON, from its .json or .json.xz file."""
    data = path.read_bytes()
    return json.loads(lzma.decompress(data) if path.name.endswith(".xz") else data)


def save(result: dict, out: Path, stem: str, markdown, plot) -> None:
    """A run's result as out/stem.json, its table `markdown(result, plot's file name)` as
    out/stem.md (printed too) and `plot(result, path)` as out/stem.png."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result, f"{stem}.png")
    (out / f"{stem}.md").write_text(text)
    plot(result, out / f"{stem}.png")
    print(text)


# ----------------------------------------------------------------------------- Markdown


def cell(value) -> str:
    """A table's cell: '-' for a figure not measured."""
    return "-" if value is None else str(value)


def cells(values) -> str:
    """A table's cell of several figures, comma-separated: '-' where they were not measured."""
    return "-" if values is None else ", ".join(map(str, values))


def markdown(result: dict) -> str:
    h = result["header"]
    m = h["machine"]
    gpus = ", ".join(m["gpus"]) or "no GPU"
    stages = ("both stages in one Python stub (`speech`, model_repository_one_stub)" if h.get("one_stub")
              else "the stages as two models (model_repository)")
    if h.get("one_tick"):
        stages += ", stepped in one tick"
    lines = [f"# PersonaPlex on Triton: benchmark of {h['date']}", "",
             f"- Command: `{h['command']}`",
             f"- Bench machine: {m['cpu']}, {m['cores']} cores, {gpus}",
             f"- Server: {h['server']}, Triton {h['triton_version']}; {stages}",
             f"- Checkpoint: {h['checkpoint']}",
             f"- Mimi runtime: talker {h['talker']['mimi_runtime']}, code2wav {h['code2wav']['mimi_runtime']}; "
             f"device {h['talker']['device']}; pool sizes talker {h['talker']['max_conversations']}, "
             f"code2wav {h['code2wav']['max_conversations']}",
             f"- KV cache: {h['talker'].get('kv_dtype', 'not recorded')}; send threads: "
             + ", ".join(f"{model} {h[model].get('send_threads') or 'not recorded'}" for model in ("talker", "code2wav")),
             f"- Commit {h['commit']}, started {h['started']}, bench wall time {h['wall_s']} s",
             # Other work on the machine skews every figure; the load average shows whether there was any.
             f"- Load average (1 min) at start {h['load_average_start']}, at end {h['load_average_end']} "
             f"({m['cores']} cores)", *_cores_and_noise_lines(h), "",
             f"Workload: `samples/user.wav` in 80 ms frames (1920 samples), voice {h['persona']['voice']}, "
             f"role prompt \"{h['persona']['text_prompt']}\", shared by every conversation (a seed each), so "
             "conversations start from the server's persona cache.", ""]
    if "first_audio_new_persona_ms" in result:
        lines += [f"First audio of the persona's first conversation (its prefill, unless the server saw "
                  f"the persona before): {result['first_audio_new_persona_ms']} ms.", ""]
    if "load" in result:
        lines += _load_section(result)
    if "perf_analyzer" in result:
        lines += ["## perf_analyzer", "",
                  "`perf_analyzer` on `ensemble`, gRPC `--streaming`, `--serial-sequences` (one frame in flight "
                  "per sequence, sent as soon as the last one is answered), one whole sequence per concurrent "
                  "slot; latencies from the per-response timestamps of `--profile-export-file`.", "",
                  "| concurrency | sequences | frames | frame p50 (ms) | frame p95 (ms) | frame p99 (ms) "
                  "| first response p50 (ms) | frames/s |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in result["perf_analyzer"]:
            lines.append(f"| {r['concurrency']} | {r['sequences']} | {r['frames']} | {cell(r['p50'])} | "
                         f"{cell(r['p95'])} | {cell(r['p99'])} | {cell(r['first_response_ms_p50'])} | "
                         f"{r['frames_per_s']} |")
        lines.append("")
    if "overhead" in result:
        o = result["overhead"]
        lines += ["## Server overhead", "",
                  f"{o['rounds']} rounds of {o['frames']} frames, one in flight, through the library's services "
                  "in the bench's process "
                  f"(checkpoint {o['in_process_checkpoint']}) and through Triton, at the server's pool sizes, "
                  "with the same persona and seed.", "",
                  "| path | frame p50 (ms) | frame p95 (ms) |", "| --- | ---: | ---: |",
                  f"| in process | {o['in_process_ms']['p50']} | {o['in_process_ms']['p95']} |",
                  f"| Triton (gRPC, ensemble) | {o['triton_ms']['p50']} | {o['triton_ms']['p95']} |", "",
                  f"Triton adds **{o['overhead_ms_p50']} ms** per frame (difference of the medians; per round: "
                  f"{', '.join(f'{d} ms' for d in o['overhead_ms_per_round'])}).", ""]
    for plot in result.get("plots", []):
        lines.append(f"![{plot}]({plot})")
    return "\n".join(lines) + "\n"


def _cores_and_noise_lines(h: dict) -> list[str]:
    """The header's cores (bench.run's pinning) and host noise, where the result has them."""
    lines = []
    if cores := h.get("cores"):
        pinned = "pinned to disjoint cores" if cores["pinned"] else "not pinned"
        server = f"server on cores {_core_list(cores['server'])}" if cores["server"] else "server's cores not seen"
        lines.append(f"- Cores: {pinned}; {server}, load generator on {_core_list(cores['load_generator'])}")
    if noise := h.get("noise"):
        parts = []
        if noise["freeze_ms_every_ms"]:
            freeze_ms, period_ms = noise["freeze_ms_every_ms"]
            parts.append(f"the server's processes frozen (SIGSTOP) {freeze_ms:g} ms every {period_ms:g} ms")
        if noise["burn_cores"]:
            parts.append(f"{noise['burn_cores']} core{'s' if noise['burn_cores'] > 1 else ''} kept busy by spinning "
                         "processes"
                         + (f" (on cores {_core_list(noise['burn_cpus'])})" if noise["burn_cpus"] else ""))
        if noise["freeze_once_ms"]:
            parts.append(f"one freeze of {noise['freeze_once_ms']:g} ms mid-level")
        lines.append("- Host noise during each level: " + "; ".join(parts))
    return lines


def _core_list(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _host_share_table(rows: list[dict]) -> list[str]:
    """What each frame cost the host's CPU, by process role, and the host's steal (loadgen.add_host_share)."""
    measured = [r for r in rows if r.get("host_share")]
    if not measured:
        return []
    roles = sorted({name for r in measured for name in r["host_share"]["cpu_ms_per_frame"]} - {LOAD_GENERATOR})
    lines = ["### The host's share", "",
             "CPU ms a frame answered (aged frames too) of each process of the server by role (from "
             "/proc/PID/stat, every thread; a server not on this host: none), their sum, the load generator's, and "
             "the host's steal over the level (/proc/stat).", "",
             "| conversations | frames | " + "".join(f"{name} | " for name in roles)
             + "server | load generator | steal % |",
             "| ---: | ---: |" + " ---: |" * (len(roles) + 3)]
    for r in measured:
        share = r["host_share"]
        lines.append(f"| {r['conversations']} | {share['frames']} | "
                     + "".join(f"{cell(share['cpu_ms_per_frame'].get(name))} | " for name in roles)
                     + f"{cell(share['server_ms_per_frame'])} | {cell(share['cpu_ms_per_frame'][LOAD_GENERATOR])} | "
                     f"{cell(share['steal_pct'])} |")
    return lines + [""]


THREAD_ROWS = 16  # the costliest threads the table shows (the JSON has every one over loadgen.THREAD_SHARE_MIN_MS)


def _threads_table(rows: list[dict]) -> list[str]:
    """The server's CPU a frame by thread at each level (loadgen.add_host_share), the threads
    costliest at the largest level first."""
    measured = [r for r in rows if r.get("host_share", {}).get("threads_ms_per_frame")]
    if not measured:
        return []
    largest = measured[-1]["host_share"]["threads_ms_per_frame"]
    names = sorted({name for r in measured for name in r["host_share"]["threads_ms_per_frame"]},
                   key=lambda name: -largest.get(name, 0.0))[:THREAD_ROWS]
    lines = ["By thread: CPU ms a frame of the server's costliest threads (from /proc/PID/task/TID/stat; the "
             "project names its threads, core/thread_names.py; \"unnamed\" are native threads: PyTorch's, CUDA's, "
             "the Python backend's).", "",
             "| role: thread | " + " | ".join(f"{r['conversations']} conv." for r in measured) + " |",
             "| --- |" + " ---: |" * len(measured)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(
            cell(r["host_share"]["threads_ms_per_frame"].get(name)) for r in measured) + " |")
    return lines + [""]


def _noise_table(rows: list[dict]) -> list[str]:
    """The freezes each level ran (loadgen.add_noise) and the recovery after a single one."""
    noisy = [r for r in rows if r.get("noise")]
    if not noisy:
        return []
    lines = ["### Host noise", "",
             "Freezes of the server's processes over each level; after a single freeze, the recovery: the time "
             "from its end until every frame sent after is answered within 80 ms (not recovered: the level's "
             "last frame was late).", "",
             "| conversations | freezes | frozen (ms) | single freeze at (s) | its length (ms) | recovery (s) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in noisy:
        noise, once = r["noise"], r["noise"].get("freeze_once")
        recovery = "-" if not once else ("not recovered" if once["recovery_s"] is None else once["recovery_s"])
        lines.append(f"| {r['conversations']} | {cell(noise.get('freezes'))} | {cell(noise.get('frozen_ms'))} | "
                     f"{cell(once and once['at_s'])} | {cell(once and once['ms'])} | {recovery} |")
    return lines + [""]


def _load_section(result: dict) -> list[str]:
    h, rows = result["header"], result["load"]
    aged = h.get("aged_context_frames", 0)
    lines = [f"## Real-time conversations{f', aged context ({aged} frames)' if aged else ''}", ""]
    if aged:
        lines += [f"**Aged context**: each conversation first streamed {aged} frames of user audio as fast as the "
                  "server took them (a real prefill through the served path, not paced and not measured); the "
                  "level's conversations then waited for each other, and only the paced part after is measured. "
                  "This does not stand for conversations of that length: there the context grows beside paced "
                  "traffic.", ""]
    lines += [f"Each conversation sends one frame every 80 ms on a fixed schedule, {h['conversation_s']:g} s "
              f"({round(h['conversation_s'] * 1000 / stats.FRAME_MS)} frames) of paced audio each. Latency: a "
              "frame's send to its answer; over 80 ms: late, the conversation falls behind its speaker. "
              f"**Held**: p99 under 80 ms, at most {stats.HELD_LATE_FRACTION:.1%} of frames over 80 ms, none over "
              f"{stats.HELD_MAX_MS:g} ms, and no failed start under capacity (a start refused at capacity where "
              "the level exceeds the talker's pool is no failure, but is counted).", ""]
    if h.get("persona_every_s"):
        lines += [f"New personas: the level's last seat is taken by one conversation after another, each "
                  f"{h['persona_every_s']:g} s apart, the first with the cached persona and every later one with a "
                  "persona the server had not seen (its role prompt names a new booking code): the level keeps "
                  "its conversations at once throughout, and each newcomer's prefill runs beside them. Their first "
                  "audio is apart from the cached starts'.", ""]
    elif h.get("new_persona"):
        lines += [f"New persona: at levels above 1 the last conversation's persona is one the server had not "
                  f"seen, starting {NEW_PERSONA_AFTER_S:g} s after the others (its prefill runs while they talk).", ""]
    lines += ["| conversations | frames | p50 (ms) | p95 (ms) | p99 (ms) | max (ms) | over 80 ms | over 160 ms "
              "| failed (refused at capacity) | first audio p50 / max (ms) | new personas: starts, first audio p50 / "
              "max (ms) | frames/s | GPU memory (GiB) | verdict |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        late = f"{r['late']} ({r['late_fraction']:.2%})" if r["frames"] else "-"
        new = (f"{r['new_persona_starts']}, {cell(r['first_audio_ms_new_persona_p50'])} / "
               f"{cell(r['first_audio_ms_new_persona_max'])}") if r["new_persona_starts"] else "-"
        lines.append(f"| {r['conversations']} | {r['frames']} | {cell(r['p50'])} | {cell(r['p95'])} | "
                     f"{cell(r['p99'])} | {cell(r['max'])} | {late} | {r['over_160']} | "
                     f"{r['failed']} ({r['refused_at_capacity']}) | {cell(r['first_audio_ms_p50'])} / "
                     f"{cell(r['first_audio_ms_max'])} | {new} | {r['frames_per_s']} | "
                     f"{cell(r.get('gpu_memory_gib'))} | {'**held**' if r['held'] else 'not held'}: {r['why']} |")
    best = result["largest_held"]
    lines += ["", "Largest number of conversations held: " + (f"**{best}**." if best else "**none** of those tested.")
              + ("" if not aged else " (aged context)"), ""]
    lines += _steal_lines(rows)
    lines += _client_table(rows)
    lines += _host_share_table(rows)
    lines += _threads_table(rows)
    lines += _noise_table(rows)
    lines += _starts_table(rows)
    lines += _windows_table(rows)
    lines += _windows_trace_table(rows)
    lines += _windows_gpu_and_host_table(rows)
    lines += _ticks_table(rows)
    lines += _collections_table(rows)
    if aged and any(r.get("ticks") for r in rows):
        lines += ["Where a frame's time goes, segment by segment, is left out with an aged context: the traces "
                  "follow a conversation's frames from its first, and its unpaced ones would swamp the paced.", ""]
    traced = [r for r in rows if r.get("trace", {}).get("frames_traced")]
    if traced:
        from personaplex_triton.core.trace import SEGMENTS

        lines += ["### Where a frame's time goes", "",
                  "From the stages' frame traces (`PERSONAPLEX_TRACE_DIR`) and the client's send and "
                  "receive times, one clock: median (p99) ms of each segment of a frame's trip; then each "
                  "stage's tick over the ticks that took these frames, and the frames per tick.", "",
                  "| segment | " + " | ".join(f"{r['conversations']} conv." for r in traced) + " |",
                  "| --- |" + " ---: |" * len(traced)]
        for name, _, _ in SEGMENTS:
            cells = [r["trace"]["segments_ms"][name] for r in traced]
            lines.append(f"| {name} | " + " | ".join(f"{c['p50']} ({c['p99']})" if c else "-" for c in cells) + " |")
        for stage in ("talker", "code2wav"):
            cells = [r["trace"]["ticks"].get(stage) for r in traced]
            lines.append(f"| {stage} tick, frames per tick | " + " | ".join(
                f"{c['p50_ms']} ({c['p99_ms']}), {c['rows_p50']:g}" if c else "-" for c in cells) + " |")
        lines.append("")
    return lines


def _client_table(rows: list[dict]) -> list[str]:
    """What the load generator's processes cost each level (loadgen.add_client)."""
    measured = [r for r in rows if r.get("client")]
    if not measured:
        return []
    lines = ["### The load generator", "",
             "The client processes each level's conversations were dealt to, their CPU time per paced frame "
             "(every thread: the send, the answer, the pacing, gRPC's own), and the busiest process's CPU over "
             "the level's wall time. A process's Python threads share one GIL: near one core, the answers it "
             "receives wait for it, and the wait counts as the server's latency.", "",
             "| conversations | client processes | CPU a frame (ms) | busiest process (cores) |",
             "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['conversations']} | {r['client']['processes']} | {cell(r['client']['cpu_ms_per_frame'])} | "
              f"{cell(r['client']['busiest_core_share'])} |" for r in measured]
    return lines + [""]


def _starts_table(rows: list[dict]) -> list[str]:
    """What new personas' starts cost the live conversations (stats.near_starts), and the talker's
    prefills in each level from the server's prefill records (loadgen.add_starts)."""
    lines = []
    near = [r for r in rows if r.get("near_starts")]
    if near:
        within = near[0]["near_starts"]["within_s"]
        lines += ["### What new personas' starts cost", "",
                  f"Frames over 80 ms (over 160 ms) of frames: the other conversations' sent within {within:g} s of "
                  f"a new persona's start, the newcomers' own within {within:g} s of theirs (they wait for it), "
                  "and the rest.", "",
                  "| conversations | others, near a start | newcomers' own | the rest |", "| ---: | ---: | ---: | ---: |"]
        for r in near:
            cells = [r["near_starts"][name] for name in ("near", "own", "elsewhere")]
            lines.append(f"| {r['conversations']} | " + " | ".join(
                f"{c['late']} ({c['over_160']}) of {c['frames']}" for c in cells) + " |")
        lines.append("")
        lines += _each_start_table(near)
    started = [r for r in rows if r.get("starts")]
    if not started:
        return lines
    lines += ["### The talker's starts", "",
             "From the server's prefill records: each start's prefill runs in chunks between the live "
             "conversations' ticks, which wait for a chunk at a time; its longest chunk, and the whole "
             "prefill, p50 / max (ms).", "",
             "| conversations | starts | longest chunk p50 / max (ms) | whole prefill p50 / max (ms) |",
             "| ---: | ---: | ---: | ---: |"]
    for r in started:
        s = r["starts"]
        lines.append(f"| {r['conversations']} | {s['count']} | {s['longest_piece_ms_p50']} / {s['longest_piece_ms_max']} "
                     f"| {s['ms_p50']} / {s['ms_max']} |")
    return lines + [""] + _each_prefill_table(started)


def _each_start_table(near: list[dict]) -> list[str]:
    """Each new persona's start on its own (stats.each_start): the others' frames it cost, and
    the newcomer's first audio."""
    levels = [r for r in near if r["near_starts"].get("each")]
    if not levels:
        return []
    lines = ["Each new persona's start: the other conversations' frames sent within "
             f"{levels[0]['near_starts']['within_s']:g} s of it, over 80 ms (over 160 ms) of them, and the "
             "newcomer's first audio.", "",
             "| conversations | start (s) | others' frames late (over 160 ms) | newcomer's first audio (ms) |",
             "| ---: | ---: | ---: | ---: |"]
    for r in levels:
        first_audio = {c["start_s"]: c["first_audio_ms"] for c in r["per_conversation"] if c["persona"] == "new"}
        for e in r["near_starts"]["each"]:
            lines.append(f"| {r['conversations']} | {e['start_s']:g} | {e['late']} ({e['over_160']}) of {e['frames']} "
                         f"| {cell(first_audio.get(e['start_s']))} |")
    return lines + [""]


def _each_prefill_table(started: list[dict]) -> list[str]:
    """Each prefill of more than one chunk on its own, from the server's prefill records and the
    talker's frame trace (loadgen.add_starts, ticks.during)."""
    levels = [r for r in started if r["starts"].get("each")]
    if not levels:
        return []
    lines = ["Each prefill on its own: when it ended (s into the level), the whole and its chunks from its "
             "record (each chunk as the engine's loop waited for it, after `begin_prefills`, a round trip to the "
             "talker's process where it has one); from the talker's trace, the gaps over 1 ms between its ticks "
             "(a chunk it waited for, or no frame waiting) and "
             "its ticks from the one before the prefill to the one after (a chunk whose GPU work it did not "
             "wait for lengthens the next tick), ms.", "",
             "| conversations | ended (s) | whole (ms) | begun in (ms) | chunks (ms) | longest (ms) "
             "| gaps between ticks (ms) | ticks (ms) |",
             "| ---: | ---: | ---: | ---: | --- | ---: | --- | --- |"]
    for r in levels:
        for e in r["starts"]["each"]:
            pieces = cells(e.get("pieces_ms")) if e.get("pieces_ms") is not None else str(e["pieces"])
            lines.append(f"| {r['conversations']} | {e['end_s']:g} | {e['ms']} | {cell(e.get('begin_ms'))} | {pieces} "
                         f"| {e['longest_ms']} | {cells(e.get('gaps_ms'))} | {cells(e.get('ticks_ms'))} |")
    return lines + [""]


def _windows_table(rows: list[dict]) -> list[str]:
    """p99 and frames over 80 ms per window along each level's run: a drift shows down a column."""
    longest = max(rows, key=lambda r: len(r["windows"]))["windows"]
    if not longest:
        return []
    lines = ["### Along the run", "",
             "Frames by when they were sent, per window of the level's paced part: p99 ms (frames over 80 ms).", "",
             "| from (s) | " + " | ".join(f"{r['conversations']} conv." for r in rows) + " |",
             "| ---: |" + " ---: |" * len(rows)]
    for i, window in enumerate(longest):
        cells = [r["windows"][i] if i < len(r["windows"]) else None for r in rows]
        lines.append(f"| {window['start_s']:g} | " + " | ".join(
            f"{c['p99']} ({c['late']})" if c and c["frames"] else "-" for c in cells) + " |")
    return lines + [""]


# The segments of a frame's trip that a window's table shows (core/trace.py SEGMENTS; the JSON has them all):
# where a frame waits on a stage's tick, or on its sending.
WINDOW_SEGMENTS = ("wait for a talker tick", "talker tick", "talker send", "wait for a code2wav tick", "code2wav send")


def _window_start(row: dict, window: dict) -> str:
    """The first cells of a window's line: the level's conversations, the window's start, its p99 (late frames)."""
    latency = f"{window['p99']} ({window['late']})" if window["frames"] else "-"
    return f"| {row['conversations']} | {window['start_s']:g} | {latency}"


def _windows_trace_table(rows: list[dict]) -> list[str]:
    """Per window along each traced level's run, the talker's ticks and the segments' medians
    (loadgen.add_traces), beside its p99: what changed when latency did shows across a row."""
    traced = [r for r in rows if r["windows"] and "ticks" in r["windows"][0]]
    if not traced:
        return []
    lines = ["### Along the run, where the time goes", "",
             "The same windows, from the stages' frame traces: the talker's ticks that started in the window (ticks "
             "per second, tick p50 ms, frames a tick, mean, and busy: the ticks' time over the window's; what is "
             "left is the host's time between ticks, or no frame waiting), and the median ms of segments of the "
             "trip of the frames sent in it (as in \"Where a frame's time goes\").", "",
             "| conv. | from (s) | p99 (over 80 ms) | talker ticks/s | talker tick p50 (ms) | frames a tick | "
             "talker busy | " + " | ".join(WINDOW_SEGMENTS) + " |",
             "|" + " ---: |" * (7 + len(WINDOW_SEGMENTS))]
    for r in traced:
        for w in r["windows"]:
            t = w["ticks"]["talker"]
            ticking = (f"{t['ticks_per_s']} | {t['tick_ms_p50']} | {t['frames_per_tick_mean']} | {t['busy_fraction']}"
                       if t else "- | - | - | -")
            segments = [w["trace"]["segments_ms"][name] for name in WINDOW_SEGMENTS]
            lines.append(f"{_window_start(r, w)} | {ticking} | "
                         + " | ".join(cell(c["p50"] if c else None) for c in segments) + " |")
    return lines + [""]


# A 10 s window whose busiest second lost this much of the host's CPU to the hypervisor: an
# episode (on 12-06's H100 hosts, 13-18% for 30-40 s sank 4-minute levels that held without).
STEAL_EPISODE_PCT = 5.0


def _steal_lines(rows: list[dict]) -> list[str]:
    """How many of each level's late frames were sent in windows of the host's steal episodes:
    they differ from host to host and run to run, so a verdict is read beside them."""
    out = []
    for r in rows:
        sampled = [w for w in r.get("windows", []) if w.get("host")]
        episodes = [w for w in sampled if w["host"]["steal_pct_max"] >= STEAL_EPISODE_PCT]
        if r["late"] and episodes:
            late = sum(w["late"] for w in episodes)
            starts = ", ".join(f"{w['start_s']:g}" for w in episodes)
            out.append(f"- {r['conversations']} conversations: {late:,} of the {r['late']:,} late frames were sent in "
                       f"the {len(episodes)} of {len(sampled)} windows whose steal peaked at {STEAL_EPISODE_PCT:g}% "
                       f"or more (from {starts} s); a backlog may drain in the windows after.")
    if not out:
        return []
    return ["The host's steal episodes (the hypervisor taking the host's CPU; \"Along the run, the GPU and the "
            "host\" below):", "", *out, ""]


def _windows_gpu_and_host_table(rows: list[dict]) -> list[str]:
    """Per window along each level's run, the GPU as nvidia-smi saw it (loadgen.add_gpu_telemetry)
    and the host's CPUs as /proc/stat did (loadgen.add_host_cpu): a card that slows, or cores that
    are busy or taken by the hypervisor, show here beside the latency they cause."""
    sampled = [r for r in rows if r.get("gpu") or r.get("host")]
    if not sampled:
        return []
    lines = ["### Along the run, the GPU and the host", "",
             "Once a second, the samples taken in the window. Where nvidia-smi runs, the GPU: SM clock median "
             "(lowest), memory clock, power, GPU and memory temperature, utilisation (medians), and the clock "
             "limit reasons seen (nvidia-smi's `clocks_event_reasons` bits, or'd; 0x0 or 0x1, idle, is none). "
             "From /proc/stat, the host's CPU time over all its cores, each second's share: busy (all but idle "
             "and iowait, steal included) and steal (taken by the hypervisor for other guests), median (highest "
             "second) %.", "",
             "| conv. | from (s) | p99 (over 80 ms) | SM MHz (lowest) | memory MHz | power (W) | GPU / memory (C) "
             "| utilisation (%) | limit reasons | host CPU busy % (max) | steal % (max) |",
             "|" + " ---: |" * 8 + " --- |" + " ---: |" * 2]
    for r in sampled:
        for w in r["windows"]:
            g, h = w.get("gpu"), w.get("host")
            if not g and not h:
                continue
            gpu = (f"{cell(g['sm_mhz'])} ({cell(g['sm_mhz_min'])}) | {cell(g['mem_mhz'])} | {cell(g['power_w'])} | "
                   f"{cell(g['gpu_c'])} / {cell(g['memory_c'])} | {cell(g['utilization'])} | {g['reasons'] or '-'}"
                   if g else "- | - | - | - | - | -")
            host = f"{h['busy_pct']} ({h['busy_pct_max']}) | {h['steal_pct']} ({h['steal_pct_max']})" if h else "- | -"
            lines.append(f"{_window_start(r, w)} | {gpu} | {host} |")
    return lines + [""]


def _collections_table(rows: list[dict]) -> list[str]:
    """The stubs' garbage collections over each level, from the metrics endpoint
    (loadgen.add_collections): each holds its stub's GIL, so every thread there waits it out."""
    counted = [r for r in rows if r.get("collections")]
    if not counted:
        return []
    lines = ["### Garbage collections in the stubs", "",
             "Over each level, from `personaplex_gc_pause_seconds` on the metrics endpoint: each stub's Python "
             f"collections by generation, their count, total ms, and how many paused over {LONG_PAUSE_S * 1000:g} ms "
             "(what a stub loaded is frozen out of them, core/collector.py).", "",
             f"| conv. | model | generation | collections | total (ms) | over {LONG_PAUSE_S * 1000:g} ms |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in counted:
        for model, generations in r["collections"].items():
            for generation, c in generations.items():
                lines.append(f"| {r['conversations']} | {model} | {generation} | {c['count']} | {c['total_ms']} | {c['long']} |")
    return lines + [""]


def _ticks_table(rows: list[dict]) -> list[str]:
    """Each stage's ticks over each level's paced part (bench.ticks), where traces were read."""
    traced = [r for r in rows if r.get("ticks")]
    if not traced:
        return []
    lines = ["### Ticks", "",
             "Each stage's ticks that started during the level's paced part, from its frame traces: ticks per "
             "second, frames a tick carried (mean, p50, max), the tick's time (p50 / p99 ms), the busy "
             "fraction (the ticks' summed time over the wall time), and the time a tick spent off the CPU "
             "(its wall time less its thread's CPU time: waiting for the GIL or a lock, as a GPU wait spins), "
             "p50 / p99 ms over all ticks and p50 over the slowest 1%.", "",
             "| stage | conversations | ticks/s | frames per tick: mean, p50, max | tick p50 / p99 (ms) "
             "| busy fraction | off the CPU p50 / p99, slowest 1% (ms) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for stage in ("talker", "code2wav"):
        for r in traced:
            t = r["ticks"].get(stage)
            if t:
                off_cpu = "-" if t.get("off_cpu_ms_p50") is None else \
                    f"{t['off_cpu_ms_p50']} / {t['off_cpu_ms_p99']}, {t['slowest_off_cpu_ms_p50']}"
                lines.append(f"| {stage} | {r['conversations']} | {t['ticks_per_s']} | {t['frames_per_tick_mean']}, "
                             f"{t['frames_per_tick_p50']:g}, {t['frames_per_tick_max']} | {t['tick_ms_p50']} / "
                             f"{t['tick_ms_p99']} | {t['busy_fraction']} | {off_cpu} |")
    return lines + [""]


# ----------------------------------------------------------------------------- plots


def pyplot():
    """matplotlib's pyplot on the Agg backend: the benchmarks write files and never open a window."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: Path, title: str | None = None, fontsize: float | None = None, dpi: int = 100) -> None:
    """Title a matplotlib figure (its suptitle), lay it out, write it to `path` and close it."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plot_load(rows: list[dict], title: str, path: Path) -> None:
    """Left: p50 / p95 / p99 against conversations. Middle and right, along the run (per window
    of the paced part), one line per level: p99, and frames over 80 ms."""
    plt = pyplot()

    n = [r["conversations"] for r in rows]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 3.8))
    for key, style in (("p50", "o-"), ("p95", "s--"), ("p99", "^:")):
        left.plot(n, [r[key] for r in rows], style, label=key)
    left.axhline(stats.FRAME_MS, color="grey", lw=0.8, label="80 ms")
    left.set(xlabel="concurrent conversations", ylabel="frame latency (ms)", xticks=n, yscale="log")
    left.legend(fontsize=8)
    for level, r in enumerate(rows):
        shown = [w for w in r["windows"] if w["frames"]]
        at = [w["start_s"] for w in shown]
        middle.plot(at, [w["p99"] for w in shown], ".-", color=f"C{level}", label=str(r["conversations"]))
        right.plot(at, [w["late"] for w in shown], ".-", color=f"C{level}", label=str(r["conversations"]))
    middle.axhline(stats.FRAME_MS, color="grey", lw=0.8)
    middle.set(xlabel="time along the run (s, window start)", ylabel="p99 in the window (ms)", yscale="log")
    right.set(xlabel="time along the run (s, window start)", ylabel="frames over 80 ms in the window")
    for ax in (middle, right):
        ax.legend(title="conversations", fontsize=7)
    save_figure(fig, path, title, fontsize=9, dpi=110)


def plot_perf_analyzer(rows: list[dict], title: str, path: Path) -> None:
    plt = pyplot()

    c = [r["concurrency"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for key, style in (("p50", "o-"), ("p95", "s--"), ("p99", "^:")):
        left.plot(c, [r[key] for r in rows], style, label=f"frame {key}")
    left.plot(c, [r["first_response_ms_p50"] for r in rows], "x-", label="first response p50")
    left.axhline(stats.FRAME_MS, color="grey", lw=0.8, label="80 ms")
    left.set(xlabel="concurrency (sequences)", ylabel="latency (ms)", xticks=c)
    left.legend(fontsize=8)
    right.bar([str(x) for x in c], [r["frames_per_s"] for r in rows])
    right.axhline(1000 / stats.FRAME_MS, color="grey", lw=0.8, label="one real-time conversation")
    right.set(xlabel="concurrency (sequences)", ylabel="frames / s, all sequences")
    right.legend(fontsize=8)
    save_figure(fig, path, title, fontsize=9, dpi=110)


def plot_cdf(series: dict[str, list[float]], xlabel: str, ylabel: str, title: str, path: Path,
             log_x: bool = False) -> None:
    """Each series' values as a cumulative distribution (the share of values at most x), one
    line a label; an empty series draws no line."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label, values in series.items():
        if values:
            ordered = sorted(values)
            ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, xscale="log" if log_x else "linear")
    if ax.lines:
        ax.legend()
    ax.grid(alpha=0.3)
    save_figure(fig, path)
