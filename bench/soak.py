"""`make soak`: conversations start, talk, end or vanish against a real server for a while;
slots in use, server memory (RSS of tritonserver and its stubs) and errors over time.

    python -m bench.soak [--minutes 10] [--workers 4] [--idle-timeout 10]

Each worker runs conversations back to back, one frame per request, each request awaited:
a random persona of a few (so the persona cache both hits and misses), 5 to 25 frames, then
70% end with the end flag, 20% vanish (the stream closes without it), 10% send a malformed
frame (NaN) first, which must be refused, then end. A start refused because every slot is
taken (vanished conversations hold theirs until the idle timeout) is retried a second later.
The server runs on a copy of the model repository whose talker closes idle conversations
after --idle-timeout seconds (the shipped 60 s would make a short soak mostly waiting).

Targets (issue 11): no hang, no lost frame in a conversation that ended normally, every
malformed request refused, every slot free at the end, RSS at the end within 5% of its value
after warm-up. Results: bench/results/soak-<date>-<machine>.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from personaplex_stream import is_final_response

from personaplex_triton.core import contract
from personaplex_triton.core.metrics import scrape
from personaplex_triton.core.paths import MODEL_REPOSITORY, REPO_ROOT
from personaplex_triton.serving.launch import TritonServer

from . import report

PERSONAS = [("NATF0", "You are a wise and friendly teacher."), ("NATM0", "Be brief."),
            ("NATF0", "Talk about cooking."), ("NATM0", "")]
REQUEST_TIMEOUT_S = 120  # an unanswered request counts as a hang
RESULTS = REPO_ROOT / "bench" / "results"


def _input(name, value):
    value = np.asarray(value)
    datatype = {"f": "FP32", "i": "INT64", "O": "BYTES"}[value.dtype.kind]
    tensor = grpcclient.InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = dict(conversations=0, ended=0, vanished=0, malformed_sent=0, malformed_refused=0,
                           busy_retries=0, frames_sent=0, frames_received=0, frames_lost=0, hangs=0,
                           unexpected_errors=0)
        self.errors: list[str] = []

    def add(self, **counts):
        with self.lock:
            for key, n in counts.items():
                self.counts[key] += n

    def error(self, message: str):
        with self.lock:
            self.counts["unexpected_errors"] += 1
            if len(self.errors) < 20:
                self.errors.append(message)


def conversation(url: str, sequence_id: int, rng: random.Random, tally: Tally) -> None:
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(lambda result, error: answers.put((result, error)))

    def request(audio, start=False, end=False, extra=()):
        """(frames answered, error) of one request."""
        client.async_stream_infer(contract.MODEL_NAME, [_input(contract.AUDIO_IN, audio), *extra],
                                  sequence_id=sequence_id, sequence_start=start, sequence_end=end,
                                  enable_empty_final_response=True)
        frames = 0
        while True:
            try:
                result, error = answers.get(timeout=REQUEST_TIMEOUT_S)
            except queue.Empty:
                tally.add(hangs=1)
                return frames, "hang"
            if error is not None:
                return frames, str(error)
            if result.get_response().outputs:
                frames += 1
            if is_final_response(result):
                return frames, None

    try:
        voice, prompt = rng.choice(PERSONAS)
        persona = [_input(contract.VOICE, np.array([voice.encode()], object)),
                   _input(contract.TEXT_PROMPT, np.array([prompt.encode()], object)),
                   _input(contract.SEED, np.array([rng.randrange(1 << 31)], np.int64))]
        n = rng.randint(5, 25)
        fate = rng.choices(["end", "vanish", "malformed"], [0.7, 0.2, 0.1])[0]
        pcm = np.random.default_rng(sequence_id).uniform(-0.3, 0.3, (n, contract.FRAME_SAMPLES)).astype(np.float32)
        while True:
            got, error = request(pcm[0], start=True, extra=persona)
            if error is None or "slots are busy" not in error:
                break
            tally.add(busy_retries=1)
            time.sleep(1.0)
        tally.add(conversations=1, frames_sent=1, frames_received=got)
        if error is not None:
            tally.error(f"start: {error}")
            return
        received = got
        if fate == "malformed":
            tally.add(malformed_sent=1)
            _, error = request(np.full(contract.FRAME_SAMPLES, np.nan, np.float32))
            if error is not None and "NaN" in error:
                tally.add(malformed_refused=1)
            else:
                tally.error(f"malformed frame not refused: {error}")
        last = n if fate != "vanish" else rng.randint(1, n - 1)
        for i in range(1, last):
            got, error = request(pcm[i], end=fate != "vanish" and i == last - 1)
            received += got
            tally.add(frames_sent=1, frames_received=got)
            if error is not None:
                tally.error(f"frame {i}: {error}")
                return
        if fate == "vanish":
            tally.add(vanished=1)
            client.stop_stream(cancel_requests=True)
        else:
            tally.add(ended=1, frames_lost=last - received)
    finally:
        client.close()


def sample(server, started: float, tally: Tally) -> dict:
    metrics = scrape(server.metrics_url)
    with tally.lock:
        errors = tally.counts["unexpected_errors"]
    return {"t_s": round(time.monotonic() - started, 1), "rss_mb": round(server.rss_bytes() / 2**20, 1),
            "talker_active": metrics.get('personaplex_conversations_active{model="talker"}', 0),
            "code2wav_active": metrics.get('personaplex_conversations_active{model="code2wav"}', 0),
            "unexpected_errors": errors}


def soak_repository(root: Path, idle_timeout_s: float) -> Path:
    repository = root / "model_repository"
    shutil.copytree(MODEL_REPOSITORY, repository, ignore=shutil.ignore_patterns("__pycache__"))
    config = repository / "talker" / "config.pbtxt"
    config.write_text(re.sub(r'(key: "idle_timeout_s" value: \{ string_value: ")[^"]*"',
                             rf'\g<1>{idle_timeout_s:g}"', config.read_text()))
    return repository


def run(minutes: float, workers: int, idle_timeout_s: float, warmup_s: float, sample_s: float, log) -> dict:
    tally, samples = Tally(), []
    with tempfile.TemporaryDirectory() as tmp:
        server_log = Path(tmp) / "tritonserver.log"
        with TritonServer(soak_repository(Path(tmp), idle_timeout_s), log_path=server_log) as server:
            started = time.monotonic()
            deadline = started + minutes * 60
            ids = iter(range(1, 1 << 62))
            ids_lock = threading.Lock()

            def worker(seed):
                rng = random.Random(seed)
                while time.monotonic() < deadline:
                    with ids_lock:
                        sequence_id = next(ids)
                    try:
                        conversation(server.grpc_url, sequence_id, rng, tally)
                    except Exception as exc:  # the soak reports, it does not stop
                        tally.error(f"client: {type(exc).__name__}: {exc}")

            threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
            for t in threads:
                t.start()
            while time.monotonic() < deadline:
                samples.append(sample(server, started, tally))
                log(f"soak {samples[-1]}")
                time.sleep(sample_s)
            for t in threads:
                t.join(REQUEST_TIMEOUT_S * 2)
            ended = time.monotonic()
            # Vanished conversations hold their slots until the idle timeouts (talker: the
            # soak's; code2wav: 60 s).
            while time.monotonic() - ended < 90:
                samples.append(sample(server, started, tally))
                if samples[-1]["talker_active"] == 0 and samples[-1]["code2wav_active"] == 0:
                    break
                time.sleep(sample_s)
            log(f"soak after the load {samples[-1]}")
            final_metrics = scrape(server.metrics_url)
            info = report.server_info(server.grpc_url, server.metrics_url)
            alive_at_end = server.process.poll() is None
    warm = next((s for s in samples if s["t_s"] >= warmup_s), samples[0])
    end = samples[-1]
    return {
        "what": "soak", "command": f"python -m bench.soak --minutes {minutes:g} --workers {workers} "
                                   f"--idle-timeout {idle_timeout_s:g}",
        "machine": report.machine(), "server": info, "commit": report.git_commit(),
        "date": report.now().isoformat(timespec="seconds"), "minutes": minutes, "workers": workers,
        "idle_timeout_s": idle_timeout_s, "counts": tally.counts, "errors": tally.errors,
        "rss_mb": {"after_warmup": warm["rss_mb"], "at_warmup_s": warm["t_s"], "end": end["rss_mb"],
                   "max": max(s["rss_mb"] for s in samples),
                   "end_vs_warmup_pct": round(100 * (end["rss_mb"] / warm["rss_mb"] - 1), 2)},
        "slots_in_use_at_end": {"talker": end["talker_active"], "code2wav": end["code2wav_active"]},
        "server_alive_at_end": alive_at_end,
        "rejected": {k: v for k, v in final_metrics.items() if k.startswith("personaplex_requests_rejected_total")},
        "samples": samples,
    }


def verdict(result: dict) -> dict[str, bool]:
    c = result["counts"]
    return {
        "no hang": c["hangs"] == 0,
        "no frame lost in a conversation that ended normally": c["frames_lost"] == 0,
        "no unexpected error": c["unexpected_errors"] == 0,
        "every malformed request refused": c["malformed_refused"] == c["malformed_sent"],
        "every slot free at the end": result["slots_in_use_at_end"] == {"talker": 0, "code2wav": 0},
        "RSS at the end within 5% of after warm-up": abs(result["rss_mb"]["end_vs_warmup_pct"]) <= 5,
        "server alive at the end": result["server_alive_at_end"],
    }


def markdown(result: dict) -> str:
    m, c, r = result["machine"], result["counts"], result["rss_mb"]
    lines = [f"# Soak, {result['date']}", "",
             f"- command: `{result['command']}`", f"- machine: {m['cpu']}, {m['cores']} cores, GPUs: {m['gpus'] or 'none'}",
             f"- commit: {result['commit']}; Triton {result['server'].get('triton_version')}",
             f"- {result['minutes']:g} min, {result['workers']} workers, talker idle timeout {result['idle_timeout_s']:g} s",
             "", "| target | met |", "| --- | --- |"]
    lines += [f"| {name} | {'yes' if ok else 'NO'} |" for name, ok in verdict(result).items()]
    lines += ["", "| count | value |", "| --- | ---: |"] + [f"| {k} | {v} |" for k, v in c.items()]
    lines += ["", f"RSS (tritonserver + stubs), MB: after warm-up ({r['at_warmup_s']:g} s) {r['after_warmup']}, "
                  f"at the end {r['end']} ({r['end_vs_warmup_pct']:+.2f}%), max {r['max']}.", "",
              f"Slots in use at the end: talker {result['slots_in_use_at_end']['talker']:g}, "
              f"code2wav {result['slots_in_use_at_end']['code2wav']:g}.", "",
              "Requests refused, by model and reason (the malformed frames, and starts while every slot was taken):", ""]
    lines += [f"- `{k}`: {v:g}" for k, v in result["rejected"].items()]
    if result.get("corrections"):
        lines += ["", f"Correction: {result['corrections']}"]
    if result["errors"]:
        lines += ["", "Unexpected errors (first 20):", ""] + [f"- {e}" for e in result["errors"]]
    lines += ["", "| t (s) | RSS (MB) | talker slots | code2wav slots | unexpected errors |",
              "| ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {s['t_s']} | {s['rss_mb']} | {s['talker_active']:g} | {s['code2wav_active']:g} | {s['unexpected_errors']} |"
              for s in result["samples"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plt = report.pyplot()

    t = [s["t_s"] for s in result["samples"]]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    top.plot(t, [s["rss_mb"] for s in result["samples"]])
    top.axhline(result["rss_mb"]["after_warmup"] * 1.05, ls="--", c="grey", label="+5% of after warm-up")
    top.set_ylabel("RSS, MB")
    top.legend()
    bottom.step(t, [s["talker_active"] for s in result["samples"]], where="post", label="talker")
    bottom.step(t, [s["code2wav_active"] for s in result["samples"]], where="post", label="code2wav")
    bottom.set_ylabel("slots in use")
    bottom.set_xlabel("s since start")
    bottom.legend()
    report.save_figure(fig, path, f"Soak {result['date'][:10]}, {result['machine']['slug']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--idle-timeout", type=float, default=10)
    parser.add_argument("--warmup", type=float, default=60, help="seconds before the RSS reference")
    parser.add_argument("--sample", type=float, default=5, help="seconds between samples")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = run(args.minutes, args.workers, args.idle_timeout, args.warmup, args.sample, print)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"soak-{result['date'][:10]}-{result['machine']['slug']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(markdown(result))
    plot(result, stem.with_suffix(".png"))
    print(markdown(result).split("\n| count")[0])
    print(f"wrote {stem}.{{md,json,png}}")
    return 0 if all(verdict(result).values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
