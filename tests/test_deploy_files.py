"""The GPU deployment's files, checked with packaged tools (no image can be pulled here, so
none of them is run): docker-compose.yml by docker-compose's own `config`, the Dockerfile by
hadolint, the Kubernetes examples by kubernetes-validate against the API schemas."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from personaplex_triton.core.paths import REPO_ROOT

VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.skip(f"{name} is not installed (make deploy-deps installs it)")
    return found


def compose_config(*args: str, admin_key: str | None = "k") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERSONAPLEX_", "HF_TOKEN"))}
    if admin_key is not None:
        env["PERSONAPLEX_ADMIN_KEY"] = admin_key
    return subprocess.run([tool("docker-compose"), "-f", str(REPO_ROOT / "docker-compose.yml"), *args, "config"],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=60)


def test_compose_file_is_valid_and_serves_on_the_gpu():
    run = compose_config()
    assert run.returncode == 0, run.stderr
    services = yaml.safe_load(run.stdout)["services"]
    assert {name for name, s in services.items() if "profiles" not in s} == {"export", "triton", "gateway"}  # `up` starts these
    triton = services["triton"]
    assert {(p["published"], p["target"]) for p in triton["ports"]} == {(8000, 8000), (8001, 8001), (8002, 8002)}
    assert "/v2/health/ready" in " ".join(triton["healthcheck"]["test"])
    assert triton["depends_on"] == {"export": {"condition": "service_completed_successfully"}}
    gpu = triton["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert any(v.endswith(":/checkpoint:ro") for v in triton["volumes"]) or any(
        isinstance(v, dict) and v.get("target") == "/checkpoint" for v in triton["volumes"])
    assert triton["environment"]["PERSONAPLEX_ADMIN_KEY"] == "k"
    assert str(triton["environment"]["PERSONAPLEX_ONE_STUB"]) == "1"  # deploy/serve.sh: both stages in one stub


def test_compose_gateway_waits_for_triton_and_checks_its_own_health():
    run = compose_config()
    assert run.returncode == 0, run.stderr
    gateway = yaml.safe_load(run.stdout)["services"]["gateway"]
    assert gateway["build"]["dockerfile"] == "deploy/gateway.Dockerfile"
    assert {(p["published"], p["target"]) for p in gateway["ports"]} == {(8080, 8080)}
    assert "/healthz" in " ".join(gateway["healthcheck"]["test"])
    assert gateway["depends_on"] == {"triton": {"condition": "service_healthy"}}
    assert "--triton-url triton:8001" in gateway["command"] and "--checkpoint /checkpoint" in gateway["command"]
    assert any(v.endswith(":/checkpoint:ro") for v in gateway["volumes"])  # the voices it offers


def test_compose_scale_profile_puts_replicas_behind_the_balancer():
    run = compose_config("--profile", "scale")
    assert run.returncode == 0, run.stderr
    services = yaml.safe_load(run.stdout)["services"]
    assert services["balancer"]["profiles"] == services["triton-replica"]["profiles"] == ["scale"]
    assert "ports" not in services["triton-replica"]  # replicas share the host: only the balancer publishes
    assert services["triton-replica"]["networks"]["default"]["aliases"] == ["triton"]  # the balancer's upstream
    balancer = services["balancer"]
    assert any("deploy/nginx/personaplex-grpc.conf" in str(v) for v in balancer["volumes"])
    assert balancer["depends_on"] == {"triton-replica": {"condition": "service_healthy"}}


def test_compose_refuses_to_start_without_an_admin_key():
    run = compose_config(admin_key=None)
    assert run.returncode != 0 and "PERSONAPLEX_ADMIN_KEY" in run.stderr


def test_dockerfile_is_pinned_and_lints_clean():
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG TRITON_IMAGE=nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-py3$", dockerfile, re.M)
    run = subprocess.run([tool("hadolint"), str(REPO_ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    gateway = REPO_ROOT / "deploy" / "gateway.Dockerfile"
    assert re.search(r"^FROM python:3\.\d+-slim-\w+$", gateway.read_text(), re.M)
    run = subprocess.run([tool("hadolint"), str(gateway)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_kubernetes_examples_match_the_api_schemas():
    manifests = sorted(str(p) for p in (REPO_ROOT / "deploy" / "kubernetes").glob("*.yaml"))
    assert len(manifests) == 4
    run = subprocess.run([tool("kubernetes-validate"), "--strict", *manifests], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    kinds = {doc["kind"] for path in manifests for doc in yaml.safe_load_all(Path(path).read_text())}
    assert kinds == {"Deployment", "Service", "HorizontalPodAutoscaler"}
