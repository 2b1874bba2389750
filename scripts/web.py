"""`make web`: serve the default checkpoint to a browser, tritonserver and the gateway together.

Starts `tritonserver` on this repository's model repository (free ports, as `make demo` does)
and the gateway in front of it (`python -m personaplex_gateway`), waits until the gateway
reports Triton ready, prints the URL to open, and stops both on Ctrl-C (or SIGTERM).
Arguments after `--` go to the gateway (`python -m personaplex_gateway -h`).
"""

import argparse
import signal
import subprocess
import sys
from pathlib import Path

from personaplex_gateway.readiness import wait_answering
from personaplex_triton.core.paths import REPO_ROOT
from personaplex_triton.serving.launch import TritonServer

GATEWAY_READY_S = 60


def interrupt(_signum, _frame):
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8080, help="the gateway's port (default %(default)s)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the gateway's address (default %(default)s; 0.0.0.0 for other machines, "
                             "whose browsers give the microphone only to https pages: see docs/gateway.md)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "web", help="where the servers' logs go")
    parser.add_argument("gateway_args", nargs="*", help="after --: more arguments of the gateway")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # Ctrl-C, and SIGTERM likewise, stop both; installed even where SIGINT came in ignored (a
    # background job of a script), which Python would otherwise keep.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupt)

    triton_log, gateway_log = args.out / "tritonserver.log", args.out / "gateway.log"
    print(f"starting tritonserver (log: {triton_log}) ...", flush=True)
    try:
        with TritonServer(log_path=triton_log) as server:
            print(f"tritonserver ready in {server.ready_s:.1f} s on {server.grpc_url}; "
                  f"starting the gateway (log: {gateway_log}) ...", flush=True)
            with open(gateway_log, "wb") as log:
                gateway = subprocess.Popen(
                    [sys.executable, "-m", "personaplex_gateway", f"--triton-url={server.grpc_url}",
                     f"--host={args.host}", f"--port={args.port}", *args.gateway_args],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                local = args.host in ("127.0.0.1", "0.0.0.0", "localhost")
                wait_answering(f"http://{'127.0.0.1' if local else args.host}:{args.port}/", gateway, GATEWAY_READY_S)
                print(f"\nOpen http://{'localhost' if local else args.host}:{args.port}/\n"
                      "(Ctrl-C stops the gateway and tritonserver)", flush=True)
                gateway.wait()
                print(f"the gateway exited with code {gateway.returncode} (log: {gateway_log})", file=sys.stderr)
                return 1
            finally:
                if gateway.poll() is None:
                    gateway.terminate()
                    gateway.wait(timeout=30)
    except KeyboardInterrupt:
        print("\nstopped", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"make web: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
