"""Many hosts behind a gRPC load balancer, for real: Debian's nginx with the committed
deploy/nginx/personaplex-grpc.conf in front of two `tritonserver`s on this machine.

Eight conversations through the balancer land on both servers and each gets every frame, in
order; a server stopped mid-run (SIGTERM: its launcher drains it) answers what is pending and
refuses its conversations' next requests with an error naming the shutdown while the other's
go on, and new conversations go to the survivor.
"""

import re
import shutil
import subprocess
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

from personaplex_stream import Persona, ServerError, StreamError, stream_conversation
from personaplex_triton.core import contract
from personaplex_triton.core.paths import REPO_ROOT
from personaplex_triton.serving import model_configs
from personaplex_triton.serving.launch import TritonServer, free_port

pytestmark = pytest.mark.integration

BALANCER_CONF = REPO_ROOT / "deploy" / "nginx" / "personaplex-grpc.conf"
NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
PERSONA = Persona(voice="NATF0", text_prompt="Be brief.", seed=21)


def balancer_conf(upstreams: list[str], port: int) -> str:
    """The committed config with this test's upstreams and port in place of `triton:8001`."""
    conf = BALANCER_CONF.read_text()
    server_line = re.search(r"^(\s*)server triton:8001 (.*);$", conf, re.M)
    servers = "\n".join(f"{server_line.group(1)}server {u} {server_line.group(2)};" for u in upstreams)
    conf = conf.replace(server_line.group(0), servers)
    return conf.replace("listen 8001 http2;", f"listen 127.0.0.1:{port} http2;")


class Nginx:
    """nginx in the foreground with everything it writes under `root`."""

    def __init__(self, root: Path, upstreams: list[str]):
        self.port = free_port()
        (root / "personaplex-grpc.conf").write_text(balancer_conf(upstreams, self.port))
        (root / "nginx.conf").write_text(
            f"daemon off;\npid {root}/nginx.pid;\nerror_log {root}/error.log info;\nevents {{}}\n"
            f"http {{\n  access_log {root}/access.log;\n"
            + "".join(f"  {kind}_temp_path {root}/{kind};\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
            + f"  include {root}/personaplex-grpc.conf;\n}}\n")
        self.process = subprocess.Popen([NGINX, "-p", str(root), "-c", str(root / "nginx.conf")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"127.0.0.1:{self.port}"
        deadline = time.monotonic() + 10
        while not (root / "nginx.pid").exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start: {(root / 'error.log').read_text()}")
            time.sleep(0.1)

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def balanced(tiny_checkpoint, tmp_path_factory):
    """Two servers (pools of 8: a balancer may give one server more than half) behind nginx."""
    if NGINX is None:
        pytest.skip("nginx is not installed (make deploy-deps installs Debian's)")
    repository = tmp_path_factory.mktemp("balanced-repository")
    # No persona prefilled at load: PERSONA's role prompt makes it one that is not.
    model_configs.main(["--out", str(repository), "--set", "talker.max_conversations=8",
                        "--set", "code2wav.max_conversations=8", "--set", "talker.warm_personas="])
    env = {"PERSONAPLEX_CHECKPOINT": str(tiny_checkpoint)}
    with ExitStack() as stack:
        servers = []
        for name in ("a", "b"):
            log = tmp_path_factory.mktemp(f"server-{name}") / "tritonserver.log"
            servers.append(stack.enter_context(TritonServer(repository, env=env, log_path=log)))
        nginx = Nginx(tmp_path_factory.mktemp("nginx"), [s.grpc_url for s in servers])
        stack.callback(nginx.stop)
        yield servers, nginx


def conversations_on(server) -> set[int]:
    text = server.log_path.read_text(errors="replace")
    return {int(c) for c in re.findall(r"talker_\d+_\d+: conversation (\d+) starts", text)}


def user_audio(frames: int) -> np.ndarray:
    return np.random.default_rng(5).uniform(-0.3, 0.3, frames * contract.FRAME_SAMPLES).astype(np.float32)


def test_eight_conversations_land_on_both_servers_in_order(balanced):
    servers, nginx = balanced
    pcm = user_audio(10)
    direct = stream_conversation(pcm, url=servers[0].grpc_url, persona=PERSONA)
    results, threads = [], []
    for _ in range(8):
        threads.append(threading.Thread(
            target=lambda: results.append(stream_conversation(pcm, url=nginx.url, persona=PERSONA))))
        threads[-1].start()
    for t in threads:
        t.join()
    assert len(results) == 8
    for r in results:
        assert r.frames_received == r.frames_sent == 10
        # same persona, seed and audio as `direct`: any lost, repeated or swapped frame would differ
        np.testing.assert_allclose(r.audio, direct.audio, atol=1e-4)
        assert r.text_pieces == direct.text_pieces
    ids = {r.sequence_id for r in results}
    on_a, on_b = conversations_on(servers[0]) & ids, conversations_on(servers[1]) & ids
    assert on_a and on_b, f"all on one server: {len(on_a)} / {len(on_b)}"
    assert on_a | on_b == ids and not on_a & on_b


def test_a_stopped_server_ends_its_conversations_and_the_survivor_takes_new_ones(balanced):
    servers, nginx = balanced
    pcm = user_audio(80)
    outcomes, progress = {}, {}

    def talk(i):
        try:
            outcomes[i] = stream_conversation(pcm, url=nginx.url, persona=PERSONA, response_timeout_s=30,
                                              on_frame=lambda frame: progress.__setitem__(i, frame.index + 1))
        except StreamError as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=talk, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not (len(progress) == 4 and min(progress.values()) >= 3):  # every conversation under way
        assert time.monotonic() < deadline, f"conversations did not get going: {progress}"
        time.sleep(0.2)
    stopped, survivor = servers
    stopped.__exit__(None, None, None)  # SIGTERM: the launcher drains it, then stops tritonserver
    for t in threads:
        t.join()

    failed = {i for i, o in outcomes.items() if isinstance(o, StreamError)}
    completed = {i for i, o in outcomes.items() if not isinstance(o, StreamError)}
    assert failed and completed, f"expected conversations on both servers: {outcomes}"
    for i in failed:  # what was pending was answered; the next request was refused, saying why
        assert isinstance(outcomes[i], ServerError), repr(outcomes[i])
        assert "the server is shutting down; no new requests" in str(outcomes[i])
    for i in completed:
        assert outcomes[i].frames_received == 80
    survivor_ids = conversations_on(survivor)
    assert {outcomes[i].sequence_id for i in completed} <= survivor_ids

    after = [stream_conversation(user_audio(5), url=nginx.url, persona=PERSONA) for _ in range(3)]
    assert all(r.frames_received == 5 for r in after)
    assert {r.sequence_id for r in after} <= conversations_on(survivor)
