"""Start `tritonserver` on this repository's model repository.

Uses a `tritonserver` on PATH when there is one (NVIDIA's container), else the 2.51 build
bundled in the `nvidia-pytriton` wheel, set up as its Python backend needs: the backend stub
of this interpreter's version next to the backend, the venv's bin first on PATH (the stub
runs `python3` from there), and this interpreter's libpython on LD_LIBRARY_PATH.

    python -m personaplex_triton.serving.launch [--model-repository DIR] [--http-port 8000] ...

It stays tritonserver's parent: on SIGTERM or SIGINT it shuts the server down gracefully
(shutdown.py) and exits with its status within SHUTDOWN_BOUND_S (40 s).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import shutil
import socket
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

from ..core.paths import MODEL_REPOSITORY
from .shutdown import DRAIN_FILE, DRAIN_S, SHUTDOWN_DIR_ENV, drained, not_finalized, write_atomically

# On SIGTERM Triton waits this long for its open sequences to end and its models to unload.
# The talker has ended them by then (shutdown.py); this is room for a loaded machine. Past it
# Triton 2.51 "exits immediately", and crashes or hangs.
EXIT_TIMEOUT_S = 20
DRAIN_MARGIN_S = 5  # past the talker's drain time, the launcher stops waiting for it
# Once the models are unloaded (their stub processes exited), tritonserver stops its endpoints;
# 2.51's gRPC endpoint waits there, without end, for clients that keep a stream open. Past this
# it is killed: all is done (exit 0 if every model instance finished its finalize()).
ENDPOINTS_GRACE_S = 3
# From SIGTERM to the launcher's exit at most (the talker's drain, then Triton's shutdown):
# past it the launcher kills the server and its stub processes and exits with 1.
SHUTDOWN_BOUND_S = DRAIN_S + DRAIN_MARGIN_S + EXIT_TIMEOUT_S
# No GPU pools, no GPU metrics: quiet and quick on a CPU-only machine; harmless on a GPU one.
CPU_FLAGS = ("--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0", "--allow-gpu-metrics=false")
# APIs that let a caller change the server or map its memory: only with the admin key's header.
# Inference, health, metadata, model config and statistics stay open to clients.
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
ADMIN_KEY_HEADER = "personaplex-admin-key"  # over HTTP; over gRPC Triton expects it prefixed:
GRPC_ADMIN_KEY_HEADER = "triton-grpc-protocol-" + ADMIN_KEY_HEADER


def restricted_api_flags(admin_key: str) -> list[str]:
    """tritonserver flags of a server that faces clients: the admin APIs behind a header key on
    gRPC and HTTP, and no model control (the models loaded at start stay; load/unload refused)."""
    rule = f"{','.join(RESTRICTED_APIS)}:{ADMIN_KEY_HEADER}={admin_key}"
    return [f"--grpc-restricted-protocol={rule}", f"--http-restricted-api={rule}", "--model-control-mode=none"]


def model_parameter(model: str, key: str, model_repository: Path = MODEL_REPOSITORY) -> str:
    """A `parameters` value of a model's config.pbtxt."""
    config = (model_repository / model / "config.pbtxt").read_text()
    found = re.search(r'key: "%s" value: \{ string_value: "([^"]*)" \}' % re.escape(key), config)
    if found is None:
        raise KeyError(f"{model}/config.pbtxt has no parameter {key!r}")
    return found.group(1)


def _bundled_tritonserver() -> tuple[Path, Path]:
    spec = importlib.util.find_spec("pytriton")  # located, not imported: its client needs gevent
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no tritonserver on PATH and the nvidia-pytriton package is not installed")
    root = Path(spec.submodule_search_locations[0]) / "tritonserver"
    backends = root / "backends"
    version = "%d.%d" % sys.version_info[:2]
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    target = backends / "python" / "triton_python_backend_stub"
    if not target.exists() or target.read_bytes() != stub.read_bytes():
        shutil.copy2(stub, target)  # the backend looks for its stub beside itself
    return root / "bin" / "tritonserver", backends


def command(model_repository: Path = MODEL_REPOSITORY, http_port: int = 8000, grpc_port: int = 8001,
            metrics_port: int = 8002, gpu: bool | None = None,
            admin_key: str | None = None) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    env.setdefault("NO_TORCH_COMPILE", "1")
    on_path = shutil.which("tritonserver")
    if on_path:
        argv = [on_path]
    else:
        binary, backends = _bundled_tritonserver()
        argv = [str(binary), f"--backend-directory={backends}"]
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    if gpu is None:
        gpu = shutil.which("nvidia-smi") is not None
    argv += [f"--model-repository={model_repository}", "--disable-auto-complete-config",
             f"--exit-timeout-secs={EXIT_TIMEOUT_S}", f"--http-port={http_port}", f"--grpc-port={grpc_port}",
             f"--metrics-port={metrics_port}"]
    if not gpu:
        argv += CPU_FLAGS
    if admin_key:
        argv += restricted_api_flags(admin_key)
    return argv, env


def wait_ready(http_port: int, process: subprocess.Popen | None = None, timeout_s: float = 600) -> float:
    """Seconds until /v2/health/ready answers 200; raises if the server exits or times out."""
    start = time.monotonic()
    url = f"http://localhost:{http_port}/v2/health/ready"
    while time.monotonic() - start < timeout_s:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                if reply.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f} s")


def serve(argv: list[str], env: dict[str, str], grpc_port: int) -> int:
    """Run tritonserver until it exits; its exit status (128 + the signal if one ended it).

    SIGTERM or SIGINT (the first one): the talker drains first (shutdown.py), then tritonserver
    gets SIGTERM; past SHUTDOWN_BOUND_S the server and its stubs are killed. However it ends,
    a stub left behind (one that outlived tritonserver) is killed."""
    with tempfile.TemporaryDirectory(prefix="personaplex-shutdown-") as folder:
        # Its own process group: a terminal's Ctrl-C reaches the launcher only, which drains first.
        server = subprocess.Popen(argv, env={**env, SHUTDOWN_DIR_ENV: folder}, process_group=0)
        try:
            return _supervise(server, Path(folder), grpc_port)
        finally:
            _kill_group_left(server.pid)


def _kill_group_left(group: int) -> None:
    """Kill what is left of tritonserver's process group once it has exited: a stub that
    outlives it is reparented away, past `child_processes`, and would hold its memory."""
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:  # nothing left: the usual case
        pass


def _supervise(server: subprocess.Popen, folder: Path, grpc_port: int) -> int:
    """`serve`'s loop: wait for tritonserver, and on a signal drain, stop it, kill it if need be."""
    signalled = None

    def on_signal(signum, _frame):
        nonlocal signalled
        if signalled is None:
            signalled = time.monotonic()
            print(f"launch: {signal.Signals(signum).name}: draining, then stopping tritonserver "
                  f"(at most {SHUTDOWN_BOUND_S:.0f} s)", file=sys.stderr, flush=True)
            write_atomically(folder / DRAIN_FILE, f"localhost:{grpc_port}")

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    stopping, finished = False, None
    while True:
        try:
            status = server.wait(timeout=0.2)
            return status if status >= 0 else 128 - status
        except subprocess.TimeoutExpired:
            pass
        if signalled is None:
            continue
        waited = time.monotonic() - signalled
        if not stopping and (drained(folder) or waited > DRAIN_S + DRAIN_MARGIN_S):
            server.send_signal(signal.SIGTERM)
            stopping = True
        if stopping and finished is None and not child_processes(server.pid):
            finished = time.monotonic()  # every stub process has exited: the models are unloaded
        if finished is not None and time.monotonic() - finished > ENDPOINTS_GRACE_S:
            server.kill()
            server.wait()
            unfinished = not_finalized(folder)
            print("launch: the models are unloaded; tritonserver's gRPC endpoint was still waiting for "
                  "clients' open streams: stopped it" + (f"; not finalized: {', '.join(unfinished)}"
                                                         if unfinished else ""), file=sys.stderr, flush=True)
            return 1 if unfinished else 0
        if waited > SHUTDOWN_BOUND_S:
            break
    stubs = child_processes(server.pid)  # they hang on once tritonserver dies
    for pid in [server.pid, *stubs]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    server.wait()
    print(f"launch: tritonserver did not exit within {SHUTDOWN_BOUND_S:.0f} s of the signal; killed it "
          f"and {len(stubs)} stub processes", file=sys.stderr, flush=True)
    return 1


def child_processes(parent: int) -> dict[int, list[str]]:
    """pid -> argv of the live processes whose parent is `parent` (Linux /proc)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and argv[0]:
            children[int(entry.name)] = [a.decode(errors="replace") for a in argv]
    return children


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free now: each socket stays bound until all are, so the system
    cannot hand one port out twice (one server's HTTP and metrics ports once came out equal)."""
    with contextlib.ExitStack() as bound:
        sockets = [bound.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("localhost", 0))
        return [sock.getsockname()[1] for sock in sockets]


def free_port() -> int:
    return free_ports(1)[0]


class TritonServer:
    """A server for the lifetime of a `with` block, on free ports, started as in production:
    this module's launcher (`process`), its `tritonserver` child and that one's stub processes.

    `ready_s` is the time from launch to ready; the server's output goes to `log_path`;
    `admin_key`: the admin APIs restricted to it (`restricted_api_flags`). Leaving the block
    sends the launcher SIGTERM: the graceful shutdown, bounded by SHUTDOWN_BOUND_S.
    """

    def __init__(self, model_repository: Path = MODEL_REPOSITORY, env: dict | None = None,
                 log_path: Path | None = None, timeout_s: float = 600, admin_key: str | None = None):
        self.model_repository = model_repository
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.extra_env = env or {}
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.admin_key = admin_key
        self.ready_s: float | None = None
        self.process: subprocess.Popen | None = None

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"localhost:{self.metrics_port}"

    def tritonserver_pid(self) -> int | None:
        """The launcher's tritonserver child, while it runs."""
        return next(iter(child_processes(self.process.pid)), None)

    def stub_pids(self, model: str | None = None) -> list[int]:
        """The Python backend stub processes (serving `model`, if given)."""
        server = self.tritonserver_pid()
        if server is None:
            return []
        return [pid for pid, argv in child_processes(server).items()
                if "triton_python_backend_stub" in argv[0] and (model is None or f"/{model}/" in argv[1])]

    def rss_bytes(self) -> int:
        """Resident memory of the launcher, the server and its stub processes."""
        server = self.tritonserver_pid()
        processes = [self.process.pid] + ([server, *child_processes(server)] if server else [])
        return sum(rss_bytes(pid) for pid in processes)

    def __enter__(self) -> "TritonServer":
        argv = [sys.executable, "-m", "personaplex_triton.serving.launch", f"--model-repository={self.model_repository}",
                f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
                f"--metrics-port={self.metrics_port}"]
        if self.admin_key:
            argv.append(f"--admin-key={self.admin_key}")
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(argv, env={**os.environ, **self.extra_env}, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.ready_s = wait_ready(self.http_port, self.process, self.timeout_s)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=SHUTDOWN_BOUND_S + 15)
            except subprocess.TimeoutExpired:  # the launcher itself hangs: everything goes
                server = self.tritonserver_pid()
                os.killpg(self.process.pid, signal.SIGKILL)
                if server is not None:
                    os.killpg(server, signal.SIGKILL)
                self.process.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", type=Path, default=MODEL_REPOSITORY)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--admin-key", default=os.environ.get("PERSONAPLEX_ADMIN_KEY"),
                        help=f"restrict {', '.join(RESTRICTED_APIS)} to requests with the header "
                             f"{ADMIN_KEY_HEADER}: KEY (default: $PERSONAPLEX_ADMIN_KEY; unset: open)")
    args = parser.parse_args(argv)
    cmd, env = command(args.model_repository, args.http_port, args.grpc_port, args.metrics_port,
                       admin_key=args.admin_key)
    return serve(cmd, env, args.grpc_port)


if __name__ == "__main__":
    sys.exit(main())
