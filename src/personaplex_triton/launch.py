"""Start `tritonserver` on this repository's model repository.

Uses a `tritonserver` on PATH when there is one (NVIDIA's container), else the 2.51 build
bundled in the `nvidia-pytriton` wheel, set up as its Python backend needs: the backend stub
of this interpreter's version next to the backend, the venv's bin first on PATH (the stub
runs `python3` from there), and this interpreter's libpython on LD_LIBRARY_PATH.

    python -m personaplex_triton.launch [--model-repository DIR] [--http-port 8000] ...
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
# No GPU pools, no GPU metrics: quiet and quick on a CPU-only machine; harmless on a GPU one.
CPU_FLAGS = ("--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0", "--allow-gpu-metrics=false")


def _bundled_tritonserver() -> tuple[Path, Path]:
    import pytriton

    root = Path(pytriton.__file__).parent / "tritonserver"
    backends = root / "backends"
    version = "%d.%d" % sys.version_info[:2]
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    target = backends / "python" / "triton_python_backend_stub"
    if not target.exists() or target.read_bytes() != stub.read_bytes():
        shutil.copy2(stub, target)  # the backend looks for its stub beside itself
    return root / "bin" / "tritonserver", backends


def command(model_repository: Path = MODEL_REPOSITORY, http_port: int = 8000, grpc_port: int = 8001,
            metrics_port: int = 8002, gpu: bool | None = None) -> tuple[list[str], dict[str, str]]:
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
             "--exit-timeout-secs=5", f"--http-port={http_port}", f"--grpc-port={grpc_port}",
             f"--metrics-port={metrics_port}"]
    if not gpu:
        argv += CPU_FLAGS
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", type=Path, default=MODEL_REPOSITORY)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    args = parser.parse_args(argv)
    cmd, env = command(args.model_repository, args.http_port, args.grpc_port, args.metrics_port)
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    sys.exit(main())
