"""`make container-test`: the CPU deployment run for real, as a user runs it.

A Docker engine (one answering already, or Debian's dockerd started here, on overlay2 where the
kernel allows it, else vfs, with no bridge network, stopped again at the end), the Debian bookworm
base made here (debootstrap, docker import) and deploy/cpu.Dockerfile's image, each built once and
reused while its inputs are unchanged (their hash is the tag); then docker-compose.cpu.yml up, and
from the host: one conversation through the gRPC client (personaplex-stream), one through the
gateway's /v1/realtime, Triton's metrics, and the admin APIs refused without the key. Then compose
down, and nothing of it may be left running.

    python scripts/container_test.py [--ports 18000,18001,18002,18080] [--keep-engine]
    python scripts/container_test.py --image-only     # the base and the image, tagged :latest
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
ENGINE_DIR = REPO_ROOT / "build" / "container-engine"
WHEELS_DIR = REPO_ROOT / "build" / "wheels"  # in the build context (.dockerignore lets it through)
ROOTFS_DIR = REPO_ROOT / "build" / "container-rootfs"
DOCKERFILE = "deploy/cpu.Dockerfile"
COMPOSE_FILE = "docker-compose.cpu.yml"
PROJECT = "personaplex-container-test"
BASE_NAME = "personaplex-bookworm"
IMAGE_NAME = "personaplex-triton-cpu"
CHECKPOINT = REPO_ROOT / "checkpoints" / "tiny"
USER_WAV = REPO_ROOT / "samples" / "user.wav"
# The base: Debian's minimal system, Python 3.11 with venv, its shared libpython (the Python
# backend's stub links it) and the CA certificates; apt's lists and caches, docs and locales
# dropped (nothing is installed into it later).
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBOOTSTRAP_ARGS = ("--variant=minbase", "--include=python3,python3-venv,libpython3.11,ca-certificates", "bookworm")
DROPPED = ("var/cache/apt", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/locale",
           "usr/share/info")
# What deploy/cpu.Dockerfile copies from the repository (besides the wheels, which follow from
# pyproject.toml's pins); a change to any of them makes a new image.
IMAGE_INPUTS = ("deploy/cpu.Dockerfile", ".dockerignore", "pyproject.toml", "src", "client", "export",
                "model_repository", "model_repository_one_stub", "deploy/serve.sh", "deploy/personaplex-triton.pth")
MOSHI = "moshi==0.2.13"  # installed without its torch<2.10 pin, as the Makefile does
FRAME_SAMPLES = 1920  # 80 ms at 24 kHz: the wire contract's frame
SAMPLE_RATE = 24000


STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"container-test [{time.monotonic() - STARTED:4.0f} s]: {message}", file=sys.stderr, flush=True)


def run(argv: list[str], env: dict | None = None, check: bool = True, capture: bool = False,
        **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, env=env, cwd=REPO_ROOT, text=True,
                            capture_output=capture, **kwargs)
    if check and result.returncode != 0:
        said = (result.stdout or "") + (result.stderr or "") if capture else ""
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited with {result.returncode}\n{said[-4000:]}")
    return result


# -- the engine ------------------------------------------------------------------------------


def engine_answers(env: dict) -> bool:
    return subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30).returncode == 0


@contextlib.contextmanager
def docker_engine(keep: bool):
    """An environment whose `docker` reaches an engine: the one that answers, else dockerd started
    here (data under build/container-engine/, kept: images outlive it), stopped at the end."""
    env = dict(os.environ)
    if engine_answers(env):
        log(f"using the engine at {env.get('DOCKER_HOST', 'the default socket')}")
        yield env
        return
    root, exec_root = ENGINE_DIR / "root", ENGINE_DIR / "exec"
    for folder in (root, exec_root):
        folder.mkdir(parents=True, exist_ok=True)
    driver = storage_driver(ENGINE_DIR)
    socket_path, pid_file = ENGINE_DIR / "d.sock", ENGINE_DIR / "d.pid"
    env["DOCKER_HOST"] = f"unix://{socket_path}"
    with open(ENGINE_DIR / "dockerd.log", "ab") as output:
        dockerd = subprocess.Popen(
            ["dockerd", "--data-root", str(root), "--exec-root", str(exec_root), "--pidfile", str(pid_file),
             "-H", env["DOCKER_HOST"], "--iptables=false", "--ip-masq=false", "--bridge=none",
             f"--storage-driver={driver}"], stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not engine_answers(env):
            if dockerd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dockerd did not start: see {ENGINE_DIR / 'dockerd.log'}")
            time.sleep(0.5)
        log(f"started dockerd (pid {dockerd.pid}, storage {driver}) at {env['DOCKER_HOST']}")
        yield env
    finally:
        if keep:
            log(f"left dockerd running: DOCKER_HOST={env['DOCKER_HOST']}; kill {dockerd.pid} to stop it")
        else:
            stop_engine(dockerd, exec_root)


def storage_driver(folder: Path) -> str:
    """overlay2 where this kernel mounts an overlay in `folder` (a layer or a container costs only
    what it changes), else vfs, which copies every layer and every container whole: three
    containers of the 1.8 GB image and its layers took over 20 GB there."""
    probe = Path(tempfile.mkdtemp(dir=folder))
    lower, upper, work, merged = (probe / name for name in ("lower", "upper", "work", "merged"))
    for path in (lower, upper, work, merged):
        path.mkdir()
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    mounted = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)],
                             capture_output=True).returncode == 0
    if mounted:
        run(["umount", str(merged)])
    shutil.rmtree(probe)
    return "overlay2" if mounted else "vfs"


def stop_engine(dockerd: subprocess.Popen, exec_root: Path) -> None:
    dockerd.terminate()
    try:
        dockerd.wait(timeout=60)
    except subprocess.TimeoutExpired:
        dockerd.kill()
        dockerd.wait()
    netns = exec_root / "netns" / "default"
    if os.path.ismount(netns):  # the host network's namespace, bound there by dockerd
        run(["umount", str(netns)])
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and exec_root.as_posix().encode()
            in _cmdline(p)]
    if left:
        raise RuntimeError(f"processes of the engine outlived it: {[p.name for p in left]}")
    log("stopped dockerd")


def _cmdline(process: Path) -> bytes:
    try:
        return (process / "cmdline").read_bytes()
    except OSError:
        return b""


# -- the images ------------------------------------------------------------------------------


def image_exists(env: dict, tag: str) -> bool:
    return run(["docker", "image", "inspect", tag], env=env, check=False, capture=True).returncode == 0


def digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:16]


def base_image(env: dict) -> str:
    """personaplex-bookworm:<hash of its recipe>, made once: debootstrap, then docker import."""
    tag = f"{BASE_NAME}:{digest(DEBIAN_MIRROR.encode(), *map(str.encode, DEBOOTSTRAP_ARGS + DROPPED))}"
    if not image_exists(env, tag):
        if shutil.which("debootstrap") is None:
            raise RuntimeError("debootstrap is not installed (apt-get install debootstrap)")
        log(f"making {tag}: debootstrap {' '.join(DEBOOTSTRAP_ARGS)}")
        shutil.rmtree(ROOTFS_DIR, ignore_errors=True)
        run(["debootstrap", *DEBOOTSTRAP_ARGS, str(ROOTFS_DIR), DEBIAN_MIRROR], capture=True)
        for dropped in DROPPED:
            shutil.rmtree(ROOTFS_DIR / dropped, ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(ROOTFS_DIR), "-c", "."], stdout=subprocess.PIPE)
        run(["docker", "import", "--change", 'CMD ["bash"]', "-", tag], env=env, stdin=tar.stdout, capture=True)
        if tar.wait() != 0:
            raise RuntimeError("tar of the root file system failed")
        shutil.rmtree(ROOTFS_DIR)
    run(["docker", "tag", tag, f"{BASE_NAME}:latest"], env=env)
    return tag


def requirements() -> list[str]:
    """What the image's venv installs: pyproject.toml's pins with the export and gateway extras."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return project["dependencies"] + extras["export"] + extras["gateway"]


def download_wheels() -> None:
    """Every wheel the image installs, into build/wheels/ by this machine's pip (where torch's CPU
    wheel lies on disk, it takes that one); again only when the requirements change."""
    wanted = "\n".join(requirements() + [MOSHI]) + "\n"
    stamp = WHEELS_DIR / "requirements.txt"
    if stamp.exists() and stamp.read_text() == wanted:
        return
    shutil.rmtree(WHEELS_DIR, ignore_errors=True)
    WHEELS_DIR.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "-d", str(WHEELS_DIR)]
    log("downloading the wheels into build/wheels/")
    run(pip + requirements(), capture=True)
    run(pip + ["--no-deps", MOSHI], capture=True)
    torch = [p.name for p in WHEELS_DIR.glob("torch-*.whl")]
    if len(torch) != 1 or "+cpu" not in torch[0]:
        raise RuntimeError(f"torch's CPU wheel is needed in build/wheels/, got {torch}: pip download torch==2.13.0 "
                           "--no-deps --index-url https://download.pytorch.org/whl/cpu -d build/wheels")
    stamp.write_text(wanted)


def image_inputs_digest(base: str) -> str:
    parts = [base.encode()]
    for name in IMAGE_INPUTS:
        path = REPO_ROOT / name
        files = sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts) \
            if path.is_dir() else [path]
        for file in files:
            parts += [file.relative_to(REPO_ROOT).as_posix().encode(), file.read_bytes()]
    return digest(*parts)


def cpu_image(env: dict, base: str) -> str:
    """personaplex-triton-cpu:<hash of its inputs>, built once; older tags of it are removed."""
    tag = f"{IMAGE_NAME}:{image_inputs_digest(base)}"
    if not image_exists(env, tag):
        download_wheels()
        log(f"building {tag} ({DOCKERFILE})")
        run(["docker", "build", "--network", "host", "-f", DOCKERFILE, "--build-arg", f"BASE_IMAGE={base}",
             "-t", tag, "."], env={**env, "DOCKER_BUILDKIT": "0"}, capture=True)
        older = run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", IMAGE_NAME], env=env,
                    capture=True).stdout.split()
        for name in older:
            if name not in (tag, f"{IMAGE_NAME}:latest"):
                run(["docker", "rmi", name], env=env, check=False, capture=True)
    run(["docker", "tag", tag, f"{IMAGE_NAME}:latest"], env=env)
    return tag


def image_mb(env: dict, tag: str) -> float:
    size = run(["docker", "image", "inspect", "--format", "{{.Size}}", tag], env=env, capture=True).stdout
    return int(size) / 1e6


# -- the deployment --------------------------------------------------------------------------


def compose_command(env: dict) -> list[str]:
    """`docker compose` (v2) where the plugin is there, else Debian's docker-compose (1.29)."""
    if run(["docker", "compose", "version"], env=env, check=False, capture=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose") is None:
        raise RuntimeError("neither `docker compose` nor docker-compose is installed (apt-get install docker-compose)")
    return ["docker-compose"]


def container_ids(env: dict) -> list[str]:
    return run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"], env=env,
               capture=True).stdout.split()


def health(env: dict, service: str) -> str:
    ids = run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}",
               "--filter", f"label=com.docker.compose.service={service}"], env=env, capture=True).stdout.split()
    if not ids:
        return "absent"
    state = run(["docker", "inspect", "--format", "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}"
                 "{{end}}", ids[0]], env=env, capture=True).stdout.split()
    return state[1] if len(state) > 1 and state[0] == "running" else state[0]


def wait_healthy(env: dict, services: tuple[str, ...], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        states = {s: health(env, s) for s in services}
        if all(state == "healthy" for state in states.values()):
            return
        if any(state in ("unhealthy", "exited", "dead", "absent") for state in states.values()) \
                or time.monotonic() > deadline:
            raise RuntimeError(f"the services did not turn healthy: {states}")
        time.sleep(1)


def port_answers(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def grpc_conversation(grpc_port: int, out_dir: Path) -> dict:
    """samples/user.wav through `personaplex-stream`, the gRPC client a user runs."""
    result = run([str(VENV_BIN / "personaplex-stream"), "--input", str(USER_WAV), "--output",
                  str(out_dir / "grpc-answer.wav"), "--url", f"127.0.0.1:{grpc_port}", "--voice", "NATF0",
                  "--seed", "1", "--json", "--no-progress"], capture=True)
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    if summary["frames_received"] != summary["frames_sent"] or summary["frames_sent"] == 0:
        raise RuntimeError(f"the gRPC conversation lost frames: {summary}")
    return summary


async def realtime_conversation(gateway_port: int, seconds: float) -> tuple[int, int]:
    """`seconds` of noise to /v1/realtime in real time (0.2 s appends, as a page sends); returns
    (frames sent, audio deltas answered), after the answer to the last frame."""
    import aiohttp

    audio = np.random.default_rng(3).uniform(-0.3, 0.3, int(seconds * SAMPLE_RATE) // FRAME_SAMPLES
                                             * FRAME_SAMPLES)
    frames, chunk = len(audio) // FRAME_SAMPLES, SAMPLE_RATE // 5
    url = f"ws://127.0.0.1:{gateway_port}/v1/realtime"
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:

        async def next_event() -> dict:
            message = await ws.receive(timeout=60)
            if message.type != aiohttp.WSMsgType.TEXT:
                raise RuntimeError(f"/v1/realtime closed: {message.type} {message.extra}")
            return json.loads(message.data)

        if (event := await next_event())["type"] != "session.created":
            raise RuntimeError(f"/v1/realtime began with {event}")
        await ws.send_str(json.dumps({"type": "session.update", "session": {"voice": "NATF0"}}))
        if (event := await next_event())["type"] != "session.updated":
            raise RuntimeError(f"/v1/realtime refused the session: {event}")

        async def send() -> None:
            start = time.perf_counter()
            for i, offset in enumerate(range(0, len(audio), chunk)):
                await asyncio.sleep(max(0.0, start + i * chunk / SAMPLE_RATE - time.perf_counter()))
                pcm16 = (audio[offset:offset + chunk] * 32767).astype("<i2").tobytes()
                await ws.send_str(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": base64.b64encode(pcm16).decode()}))

        sender = asyncio.ensure_future(send())
        answered = 0
        while answered < frames:
            event = await next_event()
            if event["type"] == "error":
                raise RuntimeError(f"/v1/realtime answered an error: {event}")
            answered += event["type"] == "response.output_audio.delta"
        await sender
    return frames, answered


def check_metrics(metrics_port: int) -> float:
    """Triton's Prometheus endpoint: the ensemble's successful requests, and the project's gauges."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    served = sum(float(line.rsplit(" ", 1)[1]) for line in lines
                 if line.startswith("nv_inference_request_success{") and 'model="ensemble"' in line)
    if served <= 0 or not any(line.startswith("personaplex_engine_up{") for line in lines):
        raise RuntimeError(f"Triton's metrics lack the conversations' requests or personaplex_engine_up "
                           f"(ensemble successes {served})")
    return served


def check_admin_apis(http_port: int, grpc_port: int, admin_key: str) -> None:
    """The secure defaults: the repository index refused without the key (HTTP 403, gRPC), given with it."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    url = f"http://127.0.0.1:{http_port}/v2/repository/index"
    try:
        urllib.request.urlopen(urllib.request.Request(url, data=b"{}"), timeout=10)
        raise RuntimeError("the repository index answered without the admin key")
    except urllib.error.HTTPError as refused:
        if refused.code != 403:
            raise RuntimeError(f"the repository index without the key: HTTP {refused.code}, not 403") from None
    keyed = urllib.request.Request(url, data=b"{}", headers={"personaplex-admin-key": admin_key})
    with urllib.request.urlopen(keyed, timeout=10) as reply:
        if "ensemble" not in {m["name"] for m in json.load(reply)}:
            raise RuntimeError("the repository index, with the key, lacks the ensemble")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        client.unload_model("ensemble")
        raise RuntimeError("unload_model over gRPC was accepted without the admin key")
    except InferenceServerException as refused:
        if "restricted" not in str(refused):
            raise RuntimeError(f"unload_model without the key failed otherwise: {refused}") from None
    finally:
        client.close()
    if not urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/models/ensemble/ready", timeout=10).status == 200:
        raise RuntimeError("the ensemble is not ready after the refused unload")


def deployment(env: dict, image: str, base: str, ports: list[int], out_dir: Path) -> dict:
    http_port, grpc_port, metrics_port, gateway_port = ports
    admin_key = secrets.token_hex(16)
    # COMPOSE_HTTP_TIMEOUT: on vfs, removing a container deletes a whole copy of the image, which
    # took docker-compose 1.29's engine calls past their 60 s on the loaded machine.
    env = {**env, "COMPOSE_HTTP_TIMEOUT": "600", "PERSONAPLEX_ADMIN_KEY": admin_key, "PERSONAPLEX_CPU_IMAGE": image, "PERSONAPLEX_BASE_IMAGE": base,
           "PERSONAPLEX_CHECKPOINT_DIR": str(CHECKPOINT), "TRITON_HTTP_PORT": str(http_port),
           "TRITON_GRPC_PORT": str(grpc_port), "TRITON_METRICS_PORT": str(metrics_port),
           "GATEWAY_PORT": str(gateway_port)}
    compose = compose_command(env) + ["-p", PROJECT, "-f", COMPOSE_FILE]
    run(compose + ["down", "--volumes"], env=env, capture=True)  # what an interrupted run left
    busy = [p for p in ports if port_answers(p)]
    if busy:
        raise RuntimeError(f"ports {busy} are taken: pick others with --ports")
    times = {}
    start = time.monotonic()
    try:
        run(compose + ["up", "-d", "--no-build"], env=env, capture=True)
        wait_healthy(env, ("triton", "gateway"), timeout_s=600)
        times["up_to_healthy_s"] = time.monotonic() - start
        summary = grpc_conversation(grpc_port, out_dir)
        log(f"gRPC conversation: {summary['frames_sent']} frames in, {summary['frames_received']} out")
        sent, answered = asyncio.run(realtime_conversation(gateway_port, seconds=2.0))
        if answered != sent:
            raise RuntimeError(f"/v1/realtime answered {answered} frames of {sent}")
        log(f"/v1/realtime conversation: {sent} frames in, {answered} out")
        log(f"metrics: {check_metrics(metrics_port):.0f} ensemble requests served")
        check_admin_apis(http_port, grpc_port, admin_key)
        log("admin APIs refused without the key, answered with it")
    except BaseException:
        logs = run(compose + ["logs", "--no-color", "--tail", "60"], env=env, check=False, capture=True)
        log("the services' logs:\n" + logs.stdout + logs.stderr)
        raise
    finally:
        down = time.monotonic()
        run(compose + ["down", "--volumes", "--timeout", "60"], env=env, capture=True)
        times["down_s"] = time.monotonic() - down
        left = container_ids(env)
        listening = [p for p in ports if port_answers(p)]
        if left or listening:
            raise RuntimeError(f"left after compose down: containers {left}, ports answering {listening}")
        log("compose down: no container of it left, its ports closed")
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", default="18000,18001,18002,18080",
                        help="Triton's HTTP, gRPC and metrics ports and the gateway's (default %(default)s)")
    parser.add_argument("--image-only", action="store_true", help="build the base and the image, run nothing")
    parser.add_argument("--keep-engine", action="store_true", help="leave a dockerd started here running")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "container-test",
                        help="where the gRPC conversation's answer is written")
    args = parser.parse_args(argv)
    ports = [int(p) for p in args.ports.split(",")]
    if len(ports) != 4:
        parser.error("--ports takes four ports")
    args.out.mkdir(parents=True, exist_ok=True)
    times, start = {}, time.monotonic()
    with docker_engine(args.keep_engine) as env:
        times["engine_s"] = time.monotonic() - start
        mark = time.monotonic()
        base = base_image(env)
        times["base_s"] = time.monotonic() - mark
        mark = time.monotonic()
        image = cpu_image(env, base)
        times["image_s"] = time.monotonic() - mark
        log(f"images: {base} {image_mb(env, base):.0f} MB, {image} {image_mb(env, image):.0f} MB")
        if not args.image_only:
            times.update(deployment(env, image, base, ports, args.out))
        mark = time.monotonic()
    times["engine_stop_s"] = time.monotonic() - mark
    times["total_s"] = time.monotonic() - start
    log("times: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
