"""The WebSocket gateway's added latency per frame, paced: N conversations of samples/user.wav,
one 80 ms frame every 80 ms each, straight to Triton over gRPC and through the gateway's
/v1/realtime, taking turns, against one server on the generated checkpoint.

Two measures of what the gateway adds. End to end: each frame's latency (sent to answered)
through the gateway less straight to Triton, at the same percentile. Its own time: what the
gateway records per frame (GET /stats), from the client's message to its hand-over to the
gRPC stream (inbound) and from Triton's answer to its send on the socket (outbound). Frames
lost: sent less answered. The target (issue 26): at most 2 ms a frame, none lost.

    python -m bench.gateway_latency                          # 1 and 16 conversations, 10 s, 2 rounds
    python -m bench.gateway_latency --conversations 1 4 --seconds 5 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import numpy as np

from personaplex_stream import Persona, stream_conversation
from personaplex_stream.audio import read_wav
from personaplex_triton.core import contract
from personaplex_triton.core.paths import MODEL_REPOSITORY, REPO_ROOT
from personaplex_triton.serving.launch import TritonServer, free_port

from . import report, stats

FRAME = contract.FRAME_SAMPLES
FRAME_S = FRAME / contract.SAMPLE_RATE
VOICE = "NATF0"  # prefilled at load with an empty role prompt: no conversation waits for a prefill
TARGET_MS = 2.0


def bench_repository(root: Path, slots: int) -> Path:
    """A copy of the model repository whose talker has `slots` conversation slots."""
    repository = root / "model_repository"
    shutil.copytree(MODEL_REPOSITORY, repository, ignore=shutil.ignore_patterns("__pycache__"))
    config = repository / "talker" / "config.pbtxt"
    config.write_text(re.sub(r'(key: "max_conversations" value: \{ string_value: ")[^"]*"', rf'\g<1>{slots}"',
                             config.read_text()))
    return repository


@contextmanager
def gateway(triton_url: str, max_connections: int):
    """`python -m personaplex_gateway` in a process of its own for one run; yields its base URL."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "personaplex_gateway", "--triton-url", triton_url,
                                "--port", str(port), "--voices", VOICE, "--max-connections", str(max_connections)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(base + "/healthz", timeout=2)
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the gateway did not come up")
                time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=15)


def direct_run(url: str, audio: np.ndarray, n: int) -> list:
    """N paced gRPC conversations straight to Triton, started 80/N ms apart: each one's frame latencies."""
    results: list = [None] * n

    def one(k: int) -> None:
        time.sleep(k * FRAME_S / n)
        try:
            result = stream_conversation(audio, url=url, realtime=True, persona=Persona(voice=VOICE, seed=k))
            results[k] = {"sent": result.frames_sent, "answered": result.frames_received,
                          "latencies_ms": result.latencies_ms}
        except Exception as exc:  # counted as lost frames, and said
            results[k] = {"sent": len(audio) // FRAME, "answered": 0, "latencies_ms": [], "error": str(exc)}

    threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


async def gateway_conversation(base: str, audio: np.ndarray, k: int, n: int) -> dict:
    """One paced /v1/realtime conversation, one frame an append: each frame's send-to-answer latency."""
    await asyncio.sleep(k * FRAME_S / n)
    frames = len(audio) // FRAME
    sent_at, latencies, errors = [], [], []
    async with aiohttp.ClientSession() as http, http.ws_connect(base.replace("http", "ws") + "/v1/realtime") as ws:
        await ws.send_str(json.dumps({"type": "session.update", "session": {"voice": VOICE, "seed": k}}))
        while json.loads((await ws.receive(timeout=60)).data)["type"] != "session.updated":
            pass
        start = time.perf_counter()

        async def send():
            for i in range(frames):
                await asyncio.sleep(max(0.0, start + i * FRAME_S - time.perf_counter()))
                pcm = (np.clip(audio[i * FRAME:(i + 1) * FRAME], -1, 1) * 32767).astype("<i2").tobytes()
                sent_at.append(time.perf_counter())
                await ws.send_str(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": base64.b64encode(pcm).decode()}))

        sender = asyncio.ensure_future(send())
        try:
            async with asyncio.timeout(5 * len(audio) / contract.SAMPLE_RATE + 30):  # an overloaded server falls behind
                while len(latencies) < frames:
                    message = await ws.receive()
                    if message.type != aiohttp.WSMsgType.TEXT:
                        errors.append(f"socket closed: {message.extra}")
                        break
                    event = json.loads(message.data)
                    if event["type"] == "response.output_audio.delta":
                        latencies.append((time.perf_counter() - sent_at[len(latencies)]) * 1e3)
                    elif event["type"] == "error":
                        errors.append(event["error"]["message"])
                        break
        except TimeoutError:
            errors.append("no answer within the run's time")
        await sender
    return {"sent": frames, "answered": len(latencies), "latencies_ms": latencies, **({"error": errors} if errors else {})}


async def gateway_run(base: str, audio: np.ndarray, n: int) -> list:
    return list(await asyncio.gather(*(gateway_conversation(base, audio, k, n) for k in range(n))))


def summarize(conversations: list) -> dict:
    latencies = [ms for c in conversations for ms in c["latencies_ms"]]
    return {**stats.frame_summary(latencies), "sent": sum(c["sent"] for c in conversations),
            "lost": sum(c["sent"] - c["answered"] for c in conversations),
            "errors": [e for c in conversations for e in ([c["error"]] if isinstance(c.get("error"), str)
                                                          else c.get("error", []))]}


def level(url: str, audio: np.ndarray, n: int, rounds: int, log) -> dict:
    runs = []
    for r in range(rounds):
        direct = summarize(direct_run(url, audio, n))
        log(f"[{n}] round {r + 1} direct: p50 {direct['p50']} p99 {direct['p99']} ms, lost {direct['lost']}")
        with gateway(url, n) as base:
            through = summarize(asyncio.run(gateway_run(base, audio, n)))
            with urllib.request.urlopen(base + "/stats", timeout=5) as reply:
                own = json.loads(reply.read())
        log(f"[{n}] round {r + 1} gateway: p50 {through['p50']} p99 {through['p99']} ms, lost {through['lost']}; "
            f"its own time in {own['inbound_ms']} out {own['outbound_ms']}")
        runs.append({"direct": direct, "gateway": through, "gateway_own": own})
    added = {q: round(float(np.median([run["gateway"][q] - run["direct"][q] for run in runs])), 1)
             for q in ("p50", "p95", "p99")}
    own_p50 = float(np.median([run["gateway_own"]["inbound_ms"]["p50"] + run["gateway_own"]["outbound_ms"]["p50"]
                               for run in runs]))
    own_p99 = float(np.median([run["gateway_own"]["inbound_ms"]["p99"] + run["gateway_own"]["outbound_ms"]["p99"]
                               for run in runs]))
    lost = sum(run["gateway"]["lost"] for run in runs)
    return {"conversations": n, "runs": runs, "added_end_to_end_ms": added,
            "own_ms_per_frame": {"p50": round(own_p50, 3), "p99": round(own_p99, 3)}, "gateway_frames_lost": lost,
            "meets_target": own_p50 <= TARGET_MS and lost == 0}


def markdown(result: dict, plot_name: str) -> str:
    h = result["header"]
    lines = [f"# The gateway's added latency per frame, paced ({h['date'][:10]}, {h['machine']['cpu']}, "
             f"{h['machine']['cores']} cores)", "",
             f"- Command: `{h['command']}`", f"- Commit {h['commit']}, started {h['date']} UTC",
             f"- Load average (1 min) at start {h['load_average_start']}, at end {h['load_average_end']}",
             f"- Server: tritonserver on the generated checkpoint, the talker with {h['slots']} slots; voice {VOICE} "
             f"(prefilled at load); {h['seconds']} s of samples/user.wav per conversation, one frame every 80 ms, "
             f"conversations started 80/N ms apart; {h['rounds']} round(s) a level, straight to Triton then through "
             "a fresh gateway process (/v1/realtime, one frame an append).",
             "- Gateway's own time: per frame, inbound (client message received -> handed to the gRPC stream) plus "
             "outbound (Triton's answer -> sent on the socket), p50 and p99 of each summed, median over rounds. "
             "Added end to end: the latency through the gateway less straight to Triton at the same percentile, "
             "median over rounds (includes the run-to-run noise of the server).", "",
             "| conversations | frames | gateway's own p50 / p99 (ms) | added end to end p50 / p95 / p99 (ms) "
             "| direct p50 / p99 (ms) | via gateway p50 / p99 (ms) | late via gateway | frames lost | target met |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in result["levels"]:
        direct = [r["direct"] for r in row["runs"]]
        via = [r["gateway"] for r in row["runs"]]
        med = lambda rows, q: round(float(np.median([x[q] for x in rows])), 1)  # noqa: E731
        a = row["added_end_to_end_ms"]
        lines.append(f"| {row['conversations']} | {sum(v['frames'] for v in via)} | "
                     f"{row['own_ms_per_frame']['p50']} / {row['own_ms_per_frame']['p99']} | "
                     f"{a['p50']} / {a['p95']} / {a['p99']} | {med(direct, 'p50')} / {med(direct, 'p99')} | "
                     f"{med(via, 'p50')} / {med(via, 'p99')} | {sum(v['late'] for v in via)} | "
                     f"{row['gateway_frames_lost']} | {'yes' if row['meets_target'] else 'no'} |")
    lines += ["", f"![latency]({plot_name})", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    names = [str(row["conversations"]) for row in levels]
    x = np.arange(len(levels))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for offset, (key, label) in zip((-0.2, 0.2), (("direct", "straight to Triton"), ("gateway", "through the gateway"))):
        p50 = [np.median([r[key]["p50"] for r in row["runs"]]) for row in levels]
        p99 = [np.median([r[key]["p99"] for r in row["runs"]]) for row in levels]
        left.bar(x + offset, p50, 0.4, label=f"{label}, p50")
        left.scatter(x + offset, p99, marker="_", s=400, color="black")
    left.axhline(80, color="grey", ls=":", lw=1)
    left.set(xticks=x, xticklabels=names, xlabel="conversations", ylabel="frame latency, ms (bar p50, dash p99)",
             title="Frame latency, paced")
    left.legend(fontsize=8)
    inbound = [np.median([r["gateway_own"]["inbound_ms"]["p50"] for r in row["runs"]]) for row in levels]
    outbound = [np.median([r["gateway_own"]["outbound_ms"]["p50"] for r in row["runs"]]) for row in levels]
    right.bar(x, inbound, 0.5, label="inbound p50")
    right.bar(x, outbound, 0.5, bottom=inbound, label="outbound p50")
    right.scatter(x, [row["own_ms_per_frame"]["p99"] for row in levels], marker="_", s=400, color="black",
                  label="in + out p99")
    right.axhline(TARGET_MS, color="red", ls="--", lw=1, label=f"target {TARGET_MS:g} ms")
    right.set(xticks=x, xticklabels=names, xlabel="conversations", ylabel="ms per frame",
              title="The gateway's own time per frame")
    right.legend(fontsize=8)
    h = result["header"]
    fig.suptitle(f"Gateway latency: {h['machine']['cpu']}, {h['machine']['cores']} cores, {h['date'][:16]} UTC, "
                 f"{h['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, nargs="+", default=[1, 16])
    p.add_argument("--seconds", type=float, default=10.0, help="user audio per conversation")
    p.add_argument("--rounds", type=int, default=2, help="turns of (direct, gateway) per level")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    p.add_argument("--name", help="the results' stem after the date (default: the machine's slug-gateway-latency)")
    report.add_commit_argument(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    audio = read_wav(REPO_ROOT / "samples" / "user.wav")
    wanted = int(args.seconds * contract.SAMPLE_RATE)
    audio = np.tile(audio, -(-wanted // audio.size))[:wanted - wanted % FRAME]
    machine = report.machine()
    started = report.now()
    load_start = round(os.getloadavg()[0], 2)
    slots = max(args.conversations)
    with tempfile.TemporaryDirectory() as tmp:
        with TritonServer(bench_repository(Path(tmp), slots), log_path=Path(tmp) / "tritonserver.log") as server:
            log(f"server ready in {server.ready_s:.1f} s with {slots} talker slots")
            levels = [level(server.grpc_url, audio, n, args.rounds, log) for n in args.conversations]
    command = "python -m bench.gateway_latency " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"header": {"command": command.strip(), "machine": machine, "commit": args.commit or report.git_commit(),
                         "date": started.isoformat(timespec="seconds"), "load_average_start": load_start,
                         "load_average_end": round(os.getloadavg()[0], 2), "slots": slots, "seconds": args.seconds,
                         "rounds": args.rounds, "target_ms": TARGET_MS},
              "levels": levels}
    stem = f"{started:%Y-%m-%d}-{args.name or machine['slug'] + '-gateway-latency'}"
    report.save(result, args.out, stem, markdown, plot)
    return 0 if all(row["meets_target"] for row in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
