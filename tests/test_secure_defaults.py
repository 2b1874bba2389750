"""A server that faces clients: without the admin key no caller can load or unload a model,
read the repository or map shared memory; with it the admin can; inference needs no key."""

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from personaplex_stream import Persona, stream_conversation
from personaplex_triton.core import contract
from personaplex_triton.serving.launch import GRPC_ADMIN_KEY_HEADER

pytestmark = pytest.mark.integration


@pytest.fixture
def client(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    yield c
    c.close()


@pytest.mark.parametrize("call", [
    lambda c, h: c.get_model_repository_index(headers=h),
    lambda c, h: c.load_model("talker", headers=h),
    lambda c, h: c.unload_model("ensemble", headers=h),
    lambda c, h: c.register_system_shared_memory("grab", "/personaplex-test", 1024, headers=h),
    lambda c, h: c.get_system_shared_memory_status(headers=h),
    lambda c, h: c.update_log_settings({"log_verbose_level": 1}, headers=h),
], ids=["repository-index", "load", "unload", "register-shm", "shm-status", "log-settings"])
@pytest.mark.parametrize("headers", [None, {GRPC_ADMIN_KEY_HEADER: "wrong"}], ids=["no-key", "wrong-key"])
def test_admin_grpc_apis_refused_without_the_key(client, call, headers):
    with pytest.raises(InferenceServerException, match="restricted"):
        call(client, headers)
    assert client.is_model_ready("talker") and client.is_model_ready("ensemble")


def test_admin_http_apis_refused_without_the_key(server, admin_headers):
    base = f"http://localhost:{server.http_port}/v2"
    for path in ("/repository/index", "/repository/models/talker/unload", "/systemsharedmemory/status"):
        request = urllib.request.Request(base + path, data=b"{}", method="POST" if "status" not in path else "GET")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 403 and "restricted" in refused.value.read().decode()
    with urllib.request.urlopen(urllib.request.Request(base + "/repository/index", data=b"{}", headers=admin_headers["http"])) as ok:
        assert {m["name"] for m in json.load(ok)} == {"talker", "code2wav", "ensemble"}


def test_the_admin_key_opens_them_and_model_control_stays_off(client, admin_headers):
    admin_headers = admin_headers["grpc"]
    index = client.get_model_repository_index(headers=admin_headers)
    assert {m.name for m in index.models} == {"talker", "code2wav", "ensemble"}
    assert client.get_system_shared_memory_status(headers=admin_headers).regions == {}
    with pytest.raises(InferenceServerException) as refused:  # past the key check, model control is off
        client.unload_model("ensemble", headers=admin_headers)
    assert "restricted" not in str(refused.value)
    assert client.is_model_ready("ensemble")


def test_inference_needs_no_key(server):
    pcm = np.random.default_rng(9).uniform(-0.3, 0.3, 3 * contract.FRAME_SAMPLES).astype(np.float32)
    result = stream_conversation(pcm, url=server.grpc_url, persona=Persona(voice="NATF0", seed=4))
    assert result.frames_received == 3
