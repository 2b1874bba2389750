"""The deployment's files, checked with packaged tools: docker-compose.yml (GPU hosts) and
docker-compose.cpu.yml by docker-compose's own `config`, the Dockerfiles by hadolint, the Kubernetes
examples by kubernetes-validate against the API schemas. The GPU files cannot run here (NVIDIA's
image cannot be pulled); the CPU ones run for real in `make container-test`."""

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


def compose_config(*args: str, admin_key: str | None = "k", file: str = "docker-compose.yml",
                   **env_vars: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PERSONAPLEX_", "HF_TOKEN", "TRITON_", "GATEWAY_"))}
    if admin_key is not None:
        env["PERSONAPLEX_ADMIN_KEY"] = admin_key
    env.update(env_vars)
    return subprocess.run([tool("docker-compose"), "-f", str(REPO_ROOT / file), *args, "config"],
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


@pytest.mark.parametrize("file", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_compose_refuses_to_start_without_an_admin_key(file):
    run = compose_config(admin_key=None, file=file)
    assert run.returncode != 0 and "PERSONAPLEX_ADMIN_KEY" in run.stderr


def test_cpu_compose_runs_the_same_services_on_the_host_network_without_gpus():
    run = compose_config(file="docker-compose.cpu.yml")
    assert run.returncode == 0, run.stderr
    services = yaml.safe_load(run.stdout)["services"]
    assert set(services) == {"export", "triton", "gateway"}
    for name, service in services.items():
        assert service["network_mode"] == "host" and "ports" not in service and "deploy" not in service, name
        assert service["build"]["dockerfile"] == "deploy/cpu.Dockerfile" and service["image"] == "personaplex-triton-cpu:latest"
        assert any(v.endswith(":/checkpoint:ro") for v in service["volumes"]), name
    triton, gateway = services["triton"], services["gateway"]
    assert triton["environment"]["PERSONAPLEX_GPUS"] == "none"  # deploy/serve.sh: one instance on the CPU
    assert triton["environment"]["PERSONAPLEX_ADMIN_KEY"] == "k"
    assert "http://127.0.0.1:8000/v2/health/ready" in " ".join(triton["healthcheck"]["test"])
    assert triton["depends_on"] == {"export": {"condition": "service_completed_successfully"}}
    assert "export_mimi.py" in services["export"]["command"]
    assert "--triton-url 127.0.0.1:8001" in gateway["command"] and "--port 8080" in gateway["command"]
    assert "http://127.0.0.1:8080/healthz" in " ".join(gateway["healthcheck"]["test"])
    assert gateway["depends_on"] == {"triton": {"condition": "service_healthy"}}
    assert gateway["user"] == "10001:10001"


def test_cpu_compose_ports_move_together():
    run = compose_config(file="docker-compose.cpu.yml", TRITON_HTTP_PORT="18000", TRITON_GRPC_PORT="18001",
                         TRITON_METRICS_PORT="18002", GATEWAY_PORT="18080")
    assert run.returncode == 0, run.stderr
    services = yaml.safe_load(run.stdout)["services"]
    environment = services["triton"]["environment"]
    assert (environment["TRITON_HTTP_PORT"], environment["TRITON_GRPC_PORT"], environment["TRITON_METRICS_PORT"]) \
        == ("18000", "18001", "18002")
    assert "127.0.0.1:18000/v2/health/ready" in " ".join(services["triton"]["healthcheck"]["test"])
    assert "--port 18080" in services["gateway"]["command"] and "127.0.0.1:18001" in services["gateway"]["command"]
    assert "127.0.0.1:18080/healthz" in " ".join(services["gateway"]["healthcheck"]["test"])


def test_dockerfile_is_pinned_and_lints_clean():
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG TRITON_IMAGE=nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-py3$", dockerfile, re.M)
    run = subprocess.run([tool("hadolint"), str(REPO_ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    gateway = REPO_ROOT / "deploy" / "gateway.Dockerfile"
    assert re.search(r"^FROM python:3\.\d+-slim-\w+$", gateway.read_text(), re.M)
    run = subprocess.run([tool("hadolint"), str(gateway)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_cpu_dockerfile_installs_only_the_wheels_of_its_context_and_lints_clean():
    cpu = REPO_ROOT / "deploy" / "cpu.Dockerfile"
    text = cpu.read_text()
    assert re.search(r"^ARG BASE_IMAGE=personaplex-bookworm:latest$", text, re.M)
    assert "COPY build/wheels /wheels" in text and text.count("--no-index --find-links /wheels") == 2
    assert "torch.version.cuda is None" in text  # a CUDA build of torch fails the build
    ignored = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    assert {".venv", "build/*", "!build/wheels", "checkpoints"} <= set(ignored)  # a lean context, with the wheels
    run = subprocess.run([tool("hadolint"), str(cpu)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_kubernetes_examples_match_the_api_schemas():
    manifests = sorted(str(p) for p in (REPO_ROOT / "deploy" / "kubernetes").glob("*.yaml"))
    assert len(manifests) == 4
    run = subprocess.run([tool("kubernetes-validate"), "--strict", *manifests], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    kinds = {doc["kind"] for path in manifests for doc in yaml.safe_load_all(Path(path).read_text())}
    assert kinds == {"Deployment", "Service", "HorizontalPodAutoscaler"}
