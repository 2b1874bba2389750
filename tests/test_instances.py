"""Several instances of each stage in one server (one per GPU on a GPU host; two on the CPU here).

Triton's sequence batcher gives each conversation to one talker and one code2wav instance and
keeps it there; a conversation's seed gives the same output alone and beside others.
"""

import re
import threading

import numpy as np
import pytest

from personaplex_stream import Persona, stream_conversation
from personaplex_triton.core import contract
from personaplex_triton.serving import model_configs
from personaplex_triton.serving.launch import TritonServer

pytestmark = pytest.mark.integration

FRAMES = 8


@pytest.fixture(scope="module")
def two_instance_server(tiny_checkpoint, tmp_path_factory):
    repository = tmp_path_factory.mktemp("two-instances")
    # Each instance prefills at load only the persona these conversations use.
    model_configs.main(["--out", str(repository), "--cpu-instances", "2", "--set", "talker.warm_personas=NATF0"])
    log = repository / "tritonserver.log"
    with TritonServer(repository, env={"PERSONAPLEX_CHECKPOINT": str(tiny_checkpoint)}, log_path=log) as server:
        yield server


def starts_by_instance(log_text: str, model: str) -> dict[str, list[int]]:
    """{instance name: conversation ids it started}, from the line each adapter logs."""
    found: dict[str, list[int]] = {}
    for instance, conversation in re.findall(rf"({model}_\d+_\d+): conversation (\d+) starts", log_text):
        found.setdefault(instance, []).append(int(conversation))
    return found


def test_conversations_spread_over_both_instances_and_keep_their_output(two_instance_server):
    pcm = np.random.default_rng(3).uniform(-0.3, 0.3, FRAMES * contract.FRAME_SAMPLES).astype(np.float32)
    url = two_instance_server.grpc_url
    alone = stream_conversation(pcm, url=url, persona=Persona(voice="NATF0", seed=11))
    results = {}

    def talk(seed):
        results[seed] = stream_conversation(pcm, url=url, persona=Persona(voice="NATF0", seed=seed))

    threads = [threading.Thread(target=talk, args=(seed,)) for seed in (11, 12, 13, 14)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert all(r.frames_received == FRAMES for r in results.values())
    np.testing.assert_allclose(results[11].audio, alone.audio, atol=1e-4)
    assert results[11].text_pieces == alone.text_pieces
    assert not np.allclose(results[12].audio, alone.audio, atol=1e-3)

    log = two_instance_server.log_path.read_text(errors="replace")
    ids = {r.sequence_id for r in (alone, *results.values())}
    for model in ("talker", "code2wav"):
        starts = starts_by_instance(log, model)
        assert sorted(starts) == [f"{model}_0_0", f"{model}_0_1"], f"{model}: {starts}"
        # every conversation started once on one instance: its frames never moved
        assert sorted(sum(starts.values(), [])) == sorted(ids)
