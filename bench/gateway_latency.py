"""The WebSocket gateway's added latency per frame, paced: N conversations of samples/user.wav,
one 80 ms frame every 80 ms each, through a fresh gateway on each of its protocols
(/v1/realtime: one PCM16 frame an append; /api/chat: one Ogg/Opus piece a frame) and straight
to Triton over gRPC for reference, taking turns, against one server on the generated checkpoint.

What the gateway adds, two ways, both from the same run's frames. End to end: a frame's latency
as its client sees it (sent to answered) less the gateway's own round trip to Triton for the
frames of that run (hand-over to the stream to the answer, GET /stats), at the same percentile:
the socket hops, decoding and encoding, and the gateway's scheduling; the server's own time and
its variance cancel. Its own time: what the gateway records per frame, from the client's
message to the frame's hand-over (inbound) and from Triton's answer to its send on the socket
(outbound). Frames lost: sent less answered. The target (issue 26): at most 2 ms a frame, none
lost.

    python -m bench.gateway_latency                          # 1 and 16 conversations, 10 s, 2 rounds
    python -m bench.gateway_latency --conversations 1 4 --seconds 5 --rounds 1 --protocols realtime
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
import sphn

from personaplex_gateway.readiness import wait_answering
from personaplex_stream import Persona, stream_conversation
from personaplex_stream.audio import read_wav
from personaplex_triton.core import contract
from personaplex_triton.core.metrics import scrape
from personaplex_triton.core.paths import MODEL_REPOSITORY, REPO_ROOT
from personaplex_triton.serving.launch import TritonServer, free_port

from . import report, stats

FRAME = contract.FRAME_SAMPLES
FRAME_S = FRAME / contract.SAMPLE_RATE
VOICE = "NATF0"  # prefilled at load with an empty role prompt: no conversation waits for a prefill
TARGET_MS = 2.0
ACTIVE = 'personaplex_conversations_active{model="talker"}'


def bench_repository(root: Path, slots: int) -> Path:
    """A copy of the model repository whose two stages have `slots` conversation slots each."""
    repository = root / "model_repository"
    shutil.copytree(MODEL_REPOSITORY, repository, ignore=shutil.ignore_patterns("__pycache__"))
    for stage in ("talker", "code2wav"):
        config = repository / stage / "config.pbtxt"
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
        wait_answering(base, process, 30)
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


async def realtime_conversation(base: str, audio: np.ndarray, k: int, n: int) -> dict:
    """One paced /v1/realtime conversation, one frame an append: each frame's send-to-answer latency."""
    await asyncio.sleep(k * FRAME_S / n)
    frames = len(audio) // FRAME
    sent_at, latencies, errors = [], [], []
    async with aiohttp.ClientSession() as http, http.ws_connect(base.replace("http", "ws") + "/v1/realtime") as ws:
        await ws.send_str(json.dumps({"type": "session.update", "session": {"voice": VOICE, "seed": k}}))
        while True:
            message = await ws.receive(timeout=60)
            if message.type != aiohttp.WSMsgType.TEXT:
                return {"sent": frames, "answered": 0, "latencies_ms": [], "error": [f"socket closed: {message.extra}"]}
            event = json.loads(message.data)
            if event["type"] == "error":
                return {"sent": frames, "answered": 0, "latencies_ms": [], "error": [event["error"]["message"]]}
            if event["type"] == "session.updated":
                break
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
                    received = time.perf_counter()  # before this client's own decoding
                    if message.type != aiohttp.WSMsgType.TEXT:
                        errors.append(f"socket closed: {message.extra}")
                        break
                    event = json.loads(message.data)
                    if event["type"] == "response.output_audio.delta":
                        latencies.append((received - sent_at[len(latencies)]) * 1e3)
                    elif event["type"] == "error":
                        errors.append(event["error"]["message"])
                        break
        except TimeoutError:
            errors.append("no answer within the run's time")
        await sender
    return {"sent": frames, "answered": len(latencies), "latencies_ms": latencies, **({"error": errors} if errors else {})}


async def chat_conversation(base: str, audio: np.ndarray, k: int, n: int) -> dict:
    """One paced /api/chat conversation, one Ogg/Opus piece a frame: frame i is answered when the
    agent's decoded audio reaches its end."""
    await asyncio.sleep(k * FRAME_S / n)
    frames = len(audio) // FRAME
    writer, reader = sphn.OpusStreamWriter(contract.SAMPLE_RATE), sphn.OpusStreamReader(contract.SAMPLE_RATE)
    sent_at, latencies, errors, decoded = [], [], [], 0
    url = base.replace("http", "ws") + f"/api/chat?voice_prompt={VOICE}.pt&text_prompt=&seed={k}"
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        handshake = await ws.receive(timeout=60)
        if handshake.data != b"\x00":
            return {"sent": frames, "answered": 0, "latencies_ms": [],
                    "error": [f"no handshake: {handshake.data!r} {handshake.extra}"]}
        start = time.perf_counter()

        async def send():
            for i in range(frames):
                await asyncio.sleep(max(0.0, start + i * FRAME_S - time.perf_counter()))
                ogg = bytes(writer.append_pcm(audio[i * FRAME:(i + 1) * FRAME]))
                sent_at.append(time.perf_counter())
                if ogg:
                    await ws.send_bytes(b"\x01" + ogg)

        sender = asyncio.ensure_future(send())
        try:
            async with asyncio.timeout(5 * len(audio) / contract.SAMPLE_RATE + 30):
                while len(latencies) < frames:
                    message = await ws.receive()
                    received = time.perf_counter()  # before this client's own decoding
                    if message.type != aiohttp.WSMsgType.BINARY:
                        errors.append(f"socket closed: {message.extra}")
                        break
                    if message.data[:1] == b"\x05":
                        errors.append(message.data[1:].decode())
                        break
                    if message.data[:1] == b"\x01":
                        decoded += np.size(reader.append_bytes(message.data[1:]))
                        while len(latencies) < min(decoded // FRAME, len(sent_at)):
                            latencies.append((received - sent_at[len(latencies)]) * 1e3)
        except TimeoutError:
            errors.append("no answer within the run's time")
        await sender
    return {"sent": frames, "answered": len(latencies), "latencies_ms": latencies, **({"error": errors} if errors else {})}


CLIENTS = {"realtime": realtime_conversation, "chat": chat_conversation}


async def gateway_run(base: str, audio: np.ndarray, n: int, protocol: str) -> list:
    return list(await asyncio.gather(*(CLIENTS[protocol](base, audio, k, n) for k in range(n))))


def summarize(conversations: list) -> dict:
    latencies = [ms for c in conversations for ms in c["latencies_ms"]]
    return {**stats.frame_summary(latencies), "sent": sum(c["sent"] for c in conversations),
            "lost": sum(c["sent"] - c["answered"] for c in conversations),
            "errors": [e for c in conversations for e in ([c["error"]] if isinstance(c.get("error"), str)
                                                          else c.get("error", []))]}


def wait_idle(server, log, timeout_s: float = 90.0) -> None:
    """Until the talker holds no conversation, so that each run starts with every slot free."""
    deadline = time.monotonic() + timeout_s
    while scrape(server.metrics_url).get(ACTIVE, 0) > 0:
        if time.monotonic() > deadline:
            log(f"the talker still holds conversations after {timeout_s:g} s; the run starts anyway")
            return
        time.sleep(0.5)


def log_errors(errors: list, log) -> None:
    for error in sorted(set(errors))[:3]:
        log(f"    {errors.count(error)} x {error}")


def level(server, audio: np.ndarray, n: int, rounds: int, protocols: list, log) -> dict:
    url, runs = server.grpc_url, []
    for r in range(rounds):
        wait_idle(server, log)
        run = {"direct": summarize(direct_run(url, audio, n))}
        log(f"[{n}] round {r + 1} direct: p50 {run['direct']['p50']} p99 {run['direct']['p99']} ms, "
            f"lost {run['direct']['lost']}")
        log_errors(run["direct"]["errors"], log)
        for protocol in protocols:
            wait_idle(server, log)
            with gateway(url, n) as base:
                through = summarize(asyncio.run(gateway_run(base, audio, n, protocol)))
                log_errors(through["errors"], log)
                with urllib.request.urlopen(base + "/stats", timeout=5) as reply:
                    own = json.loads(reply.read())
            through["added_ms"] = {q: round(through[q] - own["triton_ms"][q], 2) for q in ("p50", "p95", "p99")}
            log(f"[{n}] round {r + 1} {protocol}: p50 {through['p50']} p99 {through['p99']} ms, lost {through['lost']}, "
                f"added {through['added_ms']}; its own time in {own['inbound_ms']} out {own['outbound_ms']}")
            run[protocol] = {"client": through, "gateway_own": own}
        runs.append(run)
    row = {"conversations": n, "runs": runs}
    for protocol in protocols:
        ours = [run[protocol] for run in runs]
        median = lambda values: round(float(np.median(values)), 3)  # noqa: E731
        own = {q: median([o["gateway_own"]["inbound_ms"][q] + o["gateway_own"]["outbound_ms"][q] for o in ours])
               for q in ("p50", "p99")}
        added = {q: median([o["client"]["added_ms"][q] for o in ours]) for q in ("p50", "p95", "p99")}
        lost = sum(o["client"]["lost"] for o in ours)
        row[protocol] = {"own_ms_per_frame": own, "added_end_to_end_ms": added, "frames_lost": lost,
                         "frames": sum(o["client"]["frames"] for o in ours),
                         "late": sum(o["client"]["late"] for o in ours),
                         "client_ms": {q: median([o["client"][q] for o in ours]) for q in ("p50", "p99")},
                         "triton_ms": {q: median([o["gateway_own"]["triton_ms"][q] for o in ours]) for q in ("p50", "p99")},
                         "meets_target": added["p50"] <= TARGET_MS and lost == 0}
    row["direct_ms"] = {q: round(float(np.median([run["direct"][q] for run in runs])), 1) for q in ("p50", "p99")}
    return row


def markdown(result: dict, plot_name: str) -> str:
    h = result["header"]
    lines = [f"# The gateway's added latency per frame, paced ({h['date'][:10]}, {h['machine']['cpu']}, "
             f"{h['machine']['cores']} cores)", "",
             f"- Command: `{h['command']}`", f"- Commit {h['commit']}, started {h['date']} UTC",
             f"- Load average (1 min) at start {h['load_average_start']}, at end {h['load_average_end']}",
             f"- Server: tritonserver on the generated checkpoint, the talker with {h['slots']} slots; voice {VOICE} "
             f"(prefilled at load); {h['seconds']} s of samples/user.wav per conversation, one frame every 80 ms, "
             f"conversations started 80/N ms apart; {h['rounds']} round(s) a level: straight to Triton, then "
             "through a fresh gateway process on each protocol (/v1/realtime: one PCM16 frame an append; "
             "/api/chat: one Ogg/Opus piece a frame).",
             "- Added end to end: the frame latency the client saw less the gateway's own round trip to Triton "
             "(hand-over to answer) over the same run's frames, at the same percentile. The gateway's own time: "
             "inbound (message received -> frame handed to the stream) plus outbound (answer -> sent on the "
             "socket), p50 and p99 of each summed. Figures are medians over the rounds.", "",
             "| conversations | protocol | frames | added end to end p50 / p95 / p99 (ms) | gateway's own p50 / p99 "
             "(ms) | client sees p50 / p99 (ms) | gateway to Triton p50 / p99 (ms) | straight to Triton p50 / p99 "
             "(ms) | late (> 80 ms) | frames lost | target met |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in result["levels"]:
        for protocol in h["protocols"]:
            p = row[protocol]
            a, own, c, t, d = p["added_end_to_end_ms"], p["own_ms_per_frame"], p["client_ms"], p["triton_ms"], row["direct_ms"]
            lines.append(f"| {row['conversations']} | {protocol} | {p['frames']} | {a['p50']} / {a['p95']} / {a['p99']} | "
                         f"{own['p50']} / {own['p99']} | {c['p50']} / {c['p99']} | {t['p50']} / {t['p99']} | "
                         f"{d['p50']} / {d['p99']} | {p['late']} | {p['frames_lost']} | "
                         f"{'yes' if p['meets_target'] else 'no'} |")
    lines += ["", f"![latency]({plot_name})", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels, protocols = result["levels"], result["header"]["protocols"]
    x = np.arange(len(levels))
    width = 0.8 / len(protocols)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for j, protocol in enumerate(protocols):
        offset = (j - (len(protocols) - 1) / 2) * width
        for axis, key in ((left, "added_end_to_end_ms"), (right, "own_ms_per_frame")):
            p50 = [row[protocol][key]["p50"] for row in levels]
            p99 = [row[protocol][key]["p99"] for row in levels]
            axis.bar(x + offset, p50, width, label=f"{protocol} p50")
            axis.scatter(x + offset, p99, marker="_", s=300, color="black", label="p99" if j == 0 else None)
    for axis, title in ((left, "Added end to end: the client's latency less the gateway's to Triton"),
                        (right, "The gateway's own time (inbound + outbound)")):
        axis.axhline(TARGET_MS, color="red", ls="--", lw=1, label=f"target {TARGET_MS:g} ms")
        axis.set(xticks=x, xticklabels=[str(row["conversations"]) for row in levels], xlabel="conversations",
                 ylabel="ms per frame", title=title)
        axis.title.set_fontsize(9)
        axis.legend(fontsize=8)
    h = result["header"]
    report.save_figure(fig, path, f"Gateway latency per frame, paced: {h['machine']['cpu']}, "
                       f"{h['machine']['cores']} cores, {h['date'][:16]} UTC, {h['commit']}", fontsize=9, dpi=110)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, nargs="+", default=[1, 16])
    p.add_argument("--seconds", type=float, default=10.0, help="user audio per conversation")
    p.add_argument("--rounds", type=int, default=2, help="turns of (direct, each protocol) per level")
    p.add_argument("--protocols", nargs="+", choices=sorted(CLIENTS), default=["realtime", "chat"])
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
            levels = [level(server, audio, n, args.rounds, args.protocols, log) for n in args.conversations]
    command = "python -m bench.gateway_latency " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"header": {"command": command.strip(), "machine": machine, "commit": args.commit or report.git_commit(),
                         "date": started.isoformat(timespec="seconds"), "load_average_start": load_start,
                         "load_average_end": round(os.getloadavg()[0], 2), "slots": slots, "seconds": args.seconds,
                         "rounds": args.rounds, "protocols": args.protocols, "target_ms": TARGET_MS},
              "levels": levels}
    stem = f"{started:%Y-%m-%d}-{args.name or machine['slug'] + '-gateway-latency'}"
    report.save(result, args.out, stem, markdown, plot)
    return 0 if all(row[p]["meets_target"] for row in levels for p in args.protocols) else 1


if __name__ == "__main__":
    sys.exit(main())
