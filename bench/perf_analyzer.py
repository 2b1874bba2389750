"""perf_analyzer (tritonclient 2.51's binary) on `ensemble`: sequences of real 80 ms frames
over a gRPC stream, one frame in flight per sequence, at a given concurrency.

Its summary latency of a decoupled model is not what a listener hears, so each request's
send and response timestamps are read from `--profile-export-file` instead: per-frame
latency (send to first response) and time to first response of each sequence.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from personaplex_stream import Persona
from personaplex_triton.core import contract

from . import stats
from .workload import persona_values


class PerfAnalyzerError(RuntimeError):
    """perf_analyzer is missing, cannot start, or failed; the message says which and why."""


def binary() -> Path:
    """The perf_analyzer of this environment: tritonclient's wheel puts it beside the interpreter."""
    beside = Path(sys.executable).parent / "perf_analyzer"
    found = beside if beside.exists() else shutil.which("perf_analyzer")
    if not found:
        raise PerfAnalyzerError("perf_analyzer not found: tritonclient[grpc]==2.51.0 installs it in the "
                                "venv's bin (the 2.52+ wheels need glibc 2.38)")
    return Path(found)


def environment() -> dict[str, str]:
    """The process environment with the CUDA runtime perf_analyzer links against (libcudart.so.12,
    from the nvidia-cuda-runtime-cu12 wheel, the bench extra; no GPU is needed) on
    LD_LIBRARY_PATH, after what is there already (scripts/gpu_host.sh puts its own first)."""
    env = dict(os.environ)
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    if spec is not None and spec.submodule_search_locations:
        lib = Path(spec.submodule_search_locations[0]) / "lib"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (env.get("LD_LIBRARY_PATH", ""), str(lib)) if p)
    return env


def check() -> str:
    """perf_analyzer's version line; PerfAnalyzerError naming what is missing when it cannot start
    (libb64.so.0d: Debian's libb64-0d)."""
    try:
        done = subprocess.run([str(binary()), "--version"], env=environment(), capture_output=True, text=True,
                              timeout=30)
    except OSError as exc:
        raise PerfAnalyzerError(f"cannot run perf_analyzer: {exc}") from exc
    if done.returncode != 0:
        raise PerfAnalyzerError(f"perf_analyzer cannot start (Debian libb64-0d, or libcudart.so.12 from "
                                f"nvidia-cuda-runtime-cu12==12.6.77, missing?): "
                                f"{(done.stderr or done.stdout).strip()[-500:]}")
    return (done.stdout + done.stderr).strip()


def input_data(frames: np.ndarray, persona: Persona) -> dict:
    """perf_analyzer's --input-data JSON for one stream: a step per frame, the persona inputs on
    the first step only (the server refuses them later in a sequence)."""
    steps = []
    for i, frame in enumerate(frames):
        step = {contract.AUDIO_IN: {"content": np.asarray(frame, dtype=np.float32).tolist(),
                                    "shape": [contract.FRAME_SAMPLES]}}
        if i == 0:
            step.update({name: [value] for name, value in persona_values(persona).items()})
        steps.append(step)
    return {"data": [steps]}


def command(url: str, concurrency: int, sequence_frames: int, data_path: Path, export_path: Path,
            model: str = contract.MODEL_NAME) -> list[str]:
    return [str(binary()), "-m", model, "-u", url, "-i", "grpc", "--streaming",
            "--input-data", str(data_path),
            # No --sequence-length: with user data a sequence is the stream's steps, exactly; a set
            # length varies by +-20 % and would wrap to step 0 (the persona) mid-sequence.
            "--concurrency-range", str(concurrency),
            # One frame in flight per sequence, the next sent on its answer: a closed loop. Its
            # --request-rate-range would pace sends, but with serial sequences it waits on answers
            # too; real-time pacing is the load generator's (loadgen.py).
            "--serial-sequences",
            # Exactly `concurrency` whole sequences, side by side; no stability loop to stretch the run.
            "--request-count", str(concurrency * sequence_frames),
            "--profile-export-file", str(export_path)]


def run(url: str, concurrency: int, frames: np.ndarray, persona: Persona, workdir: Path,
        log=print, timeout_s: float = 600) -> dict:
    """One perf_analyzer run; its profile export parsed (see `parse_profile`), one experiment."""
    workdir.mkdir(parents=True, exist_ok=True)
    data_path = workdir / "input_data.json"
    data_path.write_text(json.dumps(input_data(frames, persona)))
    export_path = workdir / f"profile_export_c{concurrency}.json"
    argv = command(url, concurrency, len(frames), data_path, export_path)
    for attempt in (1, 2):
        export_path.unlink(missing_ok=True)  # perf_analyzer refuses to overwrite an export
        try:
            done = subprocess.run(argv, env=environment(), capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise PerfAnalyzerError(f"perf_analyzer ran past {timeout_s:.0f} s at concurrency {concurrency}") from exc
        if done.returncode != 0 or not export_path.exists():
            raise PerfAnalyzerError(f"perf_analyzer failed at concurrency {concurrency} (exit {done.returncode}): "
                                    f"{_problem(done.stdout + done.stderr)}")
        try:
            experiments = parse_profile(json.loads(export_path.read_text()))
            break
        except json.JSONDecodeError:
            # Seen once in a dozen runs of 2.51: an export cut at a 64 KiB boundary although
            # perf_analyzer exited 0. The measurement is lost, so it is taken again, once.
            if attempt == 2:
                raise PerfAnalyzerError(f"perf_analyzer's profile export {export_path} is not whole JSON "
                                        f"({export_path.stat().st_size} bytes), twice") from None
            log(f"  profile export cut at {export_path.stat().st_size} bytes; measuring again")
    if len(experiments) != 1:
        raise PerfAnalyzerError(f"expected one experiment in {export_path}, found {len(experiments)}")
    return experiments[0]


def _problem(output: str) -> str:
    """The error lines of perf_analyzer's output, not its usage text."""
    lines = [line for line in output.splitlines() if "rror" in line or "failed" in line.lower()]
    return " | ".join(lines[:5]) or output.strip()[-500:]


def parse_profile(export: dict) -> list[dict]:
    """Each experiment of a --profile-export-file as {"mode", "value", "sequences", "requests",
    "unanswered", "wall_s", "frame_latencies_ms", "first_response_ms"}.

    A request's latency is its first response's timestamp minus its own (the second response of
    each request is the empty final one). A sequence's first response is that of its earliest
    request. Timestamps are nanoseconds.
    """
    experiments = []
    for experiment in export["experiments"]:
        latencies, unanswered, first_request = [], 0, {}
        sent = [r["timestamp"] for r in experiment["requests"]]
        answered = [t for r in experiment["requests"] for t in r.get("response_timestamps") or []]
        for request in experiment["requests"]:
            responses = request.get("response_timestamps") or []
            if not responses:
                unanswered += 1
                continue
            latency = (responses[0] - request["timestamp"]) / 1e6
            latencies.append(latency)
            sequence = request.get("sequence_id")
            if sequence not in first_request or request["timestamp"] < first_request[sequence][0]:
                first_request[sequence] = (request["timestamp"], latency)
        experiments.append({
            "mode": experiment["experiment"]["mode"], "value": experiment["experiment"]["value"],
            "sequences": len(first_request), "requests": len(experiment["requests"]), "unanswered": unanswered,
            "wall_s": (max(answered) - min(sent)) / 1e9 if answered else None,
            "frame_latencies_ms": latencies,
            "first_response_ms": [latency for _, latency in first_request.values()],
        })
    return experiments


def summary(concurrency: int, experiment: dict) -> dict:
    """The table row of one parsed experiment; an error if any request went unanswered."""
    latencies = experiment["frame_latencies_ms"]
    if experiment["unanswered"]:
        raise PerfAnalyzerError(f"{experiment['unanswered']} of {experiment['requests']} requests "
                                f"got no response at concurrency {concurrency}")
    return {"concurrency": concurrency, "sequences": experiment["sequences"], "frames": len(latencies),
            **stats.percentiles(latencies),
            "first_response_ms_p50": stats.percentiles(experiment["first_response_ms"], (50,))["p50"],
            "frames_per_s": round(len(latencies) / experiment["wall_s"], 2)}
