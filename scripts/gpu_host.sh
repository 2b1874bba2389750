#!/usr/bin/env bash
# The server on a GPU host whose Python has numpy 2 and no Triton (the lent H200: Python 3.12,
# torch 2.11, no internet). Triton 2.51's Python-backend stub (the nvidia-pytriton build, the
# newest on PyPI) is built with pybind11 2.10, which breaks on numpy 2, so the server runs in a
# venv of its own: the host's torch and the rest through a .pth, numpy 1.26 and scipy 1.13 (built
# for it: the host's scipy does not import beside numpy 1.26) in front. Where the server's
# Python has numpy < 2, or in NVIDIA's container, none of this is needed: `make serve` works as is.
#
#   scripts/gpu_host.sh bundle       # here (any machine with pip): wheels for Python 3.12, in
#                                    # parts under build/gpu-bundle/: triton (25 MiB), packages (15 MiB),
#                                    # scipy (22 MiB), tools (py-spy, 3 MiB)
#   scripts/gpu_host.sh install PART...  # there: unpack build/gpu-bundle/PART.tar.xz (triton, packages, scipy, tools)
#   scripts/gpu_host.sh checkpoint   # there: the 7B checkpoint with random bf16 weights (checkpoints/7b)
#   scripts/gpu_host.sh test         # there, no server up: the GPU tests (they start their own servers)
#   scripts/gpu_host.sh test-library # there, packages only: the library's GPU tests (test_gpu.py, test_fp8_weights.py)
#   scripts/gpu_host.sh serve [--one-stub] [--set MODEL.KEY=VALUE ...]  # there: tritonserver in the
#                                    # background, until ready (--set: on a copy of the model repository with
#                                    # those parameters, e.g. --set talker.kv_dtype=float8_e4m3fn; --one-stub:
#                                    # model_repository_one_stub, both stages in one stub)
#   scripts/gpu_host.sh bench [ARG]  # there, against it: the load sweep, then perf_analyzer (ARG: --out DIR)
#   scripts/gpu_host.sh bench-long N SECONDS [ARG...]  # there, against it: N conversations of SECONDS
#                                    # each (240: contexts reach 3,000 frames; 300: past the limit), a new
#                                    # persona every 30 s (ARG: more bench.run options, e.g. --out DIR)
#   scripts/gpu_host.sh engine [DIR] # there, no server up (packages and a tokenizer suffice): the
#                                    # in-process step table (bf16/fp8 weights x bf16/fp8 KV, 1-128) and moshi's anchor
#   scripts/gpu_host.sh profile STAGE SECONDS DIR  # there, against it (the tools part): py-spy of STAGE's stub
#                                    # (talker or code2wav) for SECONDS, every thread and the GIL's holder at once,
#                                    # raw collapsed stacks as DIR/STAGE-pyspy.tar.xz
#   scripts/gpu_host.sh traces DIR   # there: the server's frame traces and its log as DIR/trace.tar.xz
#                                    # (to read them here: bench/ticks.py, core/trace.py)
#   scripts/gpu_host.sh run CMD...   # there: CMD in the server's Python environment
#   scripts/gpu_host.sh stop         # there: stop the server
#
# On the lent machine the parts travel with this checkout in two `device` calls, one after the
# other (a call carries at most 64 MiB, and the checkout is about 20): scipy, then packages,
# triton and tools together, which installs them and runs what it came for (a warm machine keeps
# build/, checkpoints/ and a started server between calls that follow one another).
# docs/gpu-serving.md's "Running on the lent H200" section has the exact calls.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUNDLE=build/gpu-bundle
HOST=build/gpu-host
VENV=$HOST/venv
TRACE_DIR=$ROOT/$HOST/trace  # the stages' frame traces (trace.py), for the benchmark's breakdown
CHECKPOINT=${PERSONAPLEX_CHECKPOINT:-$ROOT/checkpoints/7b}
PYV=3.12

# What the server needs beyond the host's own packages, pinned, in parts that travel apart:
# each part travels in a device call of its own beside the checkout; scipy is built for numpy 1.26.
TRITON=(nvidia-pytriton==0.7.0)
PACKAGES=(numpy==1.26.4 moshi==0.2.13 pyloudnorm==0.2.0 tritonclient==2.51.0 protobuf==4.25.9
          python-rapidjson==1.25)
SCIPY=(scipy==1.13.1)
TOOLS=(py-spy==0.4.3)  # `profile`: which thread of a stub runs, and which holds the GIL

ready() { python3 -c 'import urllib.request as u; u.urlopen("http://localhost:8000/v2/health/ready", timeout=2)' 2>/dev/null; }

site_packages() { "$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])'; }

unpack_wheels() {  # wheels in $1 -> site-packages layout in $2 (.data/purelib and platlib merged, bin/)
    local src=$1 dst=$2
    mkdir -p "$dst/bin"
    for wheel in "$src"/*.whl; do
        unzip -q -o "$wheel" -d "$dst"
    done
    for data in "$dst"/*.data; do
        [ -d "$data" ] || continue
        for lib in purelib platlib; do
            [ -d "$data/$lib" ] && cp -a "$data/$lib/." "$dst/"
        done
        [ -d "$data/data/bin" ] && cp -a "$data/data/bin/." "$dst/bin/"
        [ -d "$data/scripts" ] && cp -a "$data/scripts/." "$dst/bin/"  # py-spy's binary
        rm -rf "$data"
    done
}

bundle() {
    mkdir -p "$BUNDLE"
    local part names dir
    for part in triton packages scipy tools; do
        [ -f "$BUNDLE/$part.tar.xz" ] && { echo "$BUNDLE/$part.tar.xz is there"; continue; }
        case $part in
            triton) names=("${TRITON[@]}") ;;
            packages) names=("${PACKAGES[@]}") ;;
            scipy) names=("${SCIPY[@]}") ;;
            tools) names=("${TOOLS[@]}") ;;
        esac
        dir=$(mktemp -d)
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version $PYV --implementation cp \
            --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
            -d "$dir/wheels" "${names[@]}"
        unpack_wheels "$dir/wheels" "$dir/site"
        if [ $part = triton ]; then  # only the server, its libraries and the 3.12 stub
            rm -f "$dir"/site/nvidia_pytriton.libs/libpython3*.so*
            find "$dir/site/pytriton/tritonserver/python_backend_stubs" -mindepth 1 -maxdepth 1 ! -name $PYV \
                -exec rm -rf {} +
        fi
        rm -f "$dir/site/bin/perf_client"  # tritonclient's second copy of perf_analyzer
        tar -C "$dir/site" -cf - . | xz -T0 -9 > "$BUNDLE/$part.tar.xz.tmp"
        mv "$BUNDLE/$part.tar.xz.tmp" "$BUNDLE/$part.tar.xz"
        rm -rf "$dir"
        echo "$BUNDLE/$part.tar.xz: $(du -m "$BUNDLE/$part.tar.xz" | cut -f1) MiB"
    done
}

make_venv() {
    [ -x "$VENV/bin/python" ] && return
    local base host_site
    base=$(python3 -c 'import sys; print(sys.base_prefix)')/bin/python3
    host_site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
    "$base" -m venv --without-pip "$VENV"
    # After the venv's own packages: this checkout, then the host's packages (torch and the rest).
    printf '%s\n' "$ROOT/src" "$ROOT/client" "$ROOT" "$host_site" > "$(site_packages)/personaplex.pth"
}

install() {
    (( $# )) || { echo "install needs parts: triton, packages, scipy, tools" >&2; exit 2; }
    make_venv
    local site part
    site=$(site_packages)
    for part in "$@"; do
        xz -dc "$BUNDLE/$part.tar.xz" | tar -C "$site" -xf -
        echo "installed $part into $site"
    done
    if [ -d "$site/bin" ]; then  # perf_analyzer, beside the venv's python
        find "$site/bin" -mindepth 1 -maxdepth 1 -exec mv -f {} "$VENV/bin/" \; && rmdir "$site/bin"
    fi
    if [ -d "$site/nvidia_pytriton.libs" ]; then
        # perf_analyzer (tritonclient's wheel) links these two by their plain names; pytriton has both.
        mkdir -p "$HOST/lib"
        ln -sf "$site"/nvidia_pytriton.libs/libb64-*.so.0d "$HOST/lib/libb64.so.0d"
        ln -sf "$site"/nvidia_pytriton.libs/libcudart-*.so.12* "$HOST/lib/libcudart.so.12"
    fi
}

need_scipy() {  # pyloudnorm's filter: a WAV voice's loudness (checkpoint makes its voice bundles from WAVs)
    "$VENV/bin/python" -c 'import scipy.signal' 2>/dev/null && return
    echo "scipy does not import here beside numpy 1.26: carry $BUNDLE/scipy.tar.xz and run" \
         "'scripts/gpu_host.sh install scipy' (docs/gpu-serving.md)" >&2
    exit 1
}

environment() {
    export PATH=$ROOT/$VENV/bin:$PATH LD_LIBRARY_PATH=$ROOT/$HOST/lib:${LD_LIBRARY_PATH:-}
    export PERSONAPLEX_CHECKPOINT=$CHECKPOINT NO_TORCH_COMPILE=1 PYTHONUNBUFFERED=1
}

checkpoint() {
    environment
    need_scipy
    python export/make_tiny_checkpoint.py --size 7b --device cuda --out "$CHECKPOINT"
}

serve() {
    environment
    need_scipy
    mkdir -p "$HOST"
    if ready; then echo "already serving"; return; fi
    local started=$SECONDS
    rm -rf "$TRACE_DIR"
    local launch=() repository=model_repository configs=()
    if [[ ${1:-} == --one-stub ]]; then  # model_repository_one_stub: both stages in one stub
        repository=model_repository_one_stub configs=(--one-stub)
        shift
    fi
    if (( $# )) || [[ $repository != model_repository ]]; then
        rm -rf "${HOST:?}/$repository"
        cp -r "$repository" "$HOST/$repository"
        python -m personaplex_triton.serving.model_configs --out "$HOST/$repository" "${configs[@]}" "$@" > /dev/null
        launch=(--model-repository "$ROOT/$HOST/$repository")
    fi
    PERSONAPLEX_TRACE_DIR=$TRACE_DIR setsid python -m personaplex_triton.serving.launch "${launch[@]}" \
        > "$HOST/tritonserver.log" 2>&1 < /dev/null &
    echo $! > "$HOST/tritonserver.pid"
    until ready; do
        if ! kill -0 "$(cat "$HOST/tritonserver.pid")" 2>/dev/null; then
            tail -40 "$HOST/tritonserver.log"; echo "tritonserver exited before it was ready" >&2; exit 1
        fi
        if (( SECONDS - started > 900 )); then echo "not ready after 900 s" >&2; exit 1; fi
        sleep 1
    done
    echo "ready in $((SECONDS - started)) s; log $HOST/tritonserver.log"
    # what each stage took at load (core/metrics.py: pool, send threads, Mimi runtime, warm personas)
    python3 -c 'import urllib.request as u; print(u.urlopen("http://localhost:8002/metrics", timeout=5).read().decode())' \
        | grep -E "^personaplex_(conversation_slots|send_threads|mimi_runtime|kv_cache_dtype)" || true
}

gpu_tests() {
    environment
    need_scipy  # the server tests make checkpoints of their own
    # Apart: memory the library tests leave in the pytest process would shrink the served pool.
    # Both files run whatever the first gives; the exit status is the worse of the two.
    local served=0 library=0
    python -m pytest -q -rs tests/test_gpu_server.py || served=$?
    python -m pytest -q -rs tests/test_gpu.py tests/test_fp8_weights.py || library=$?
    return $(( served > library ? served : library ))
}

bench() {
    environment
    local common=(--url localhost:8001 "$@")
    python -m bench.run "${common[@]}" --name "$(gpu_slug)" --stages load --conversations 1 8 16 32 48 64 76 96 \
        --seconds 30 --new-persona --trace-dir "$TRACE_DIR"
    python -m bench.run "${common[@]}" --name "$(gpu_slug)-perf-analyzer" --stages perf-analyzer --pa-concurrency 1 16 64
}

gpu_slug() {  # the card, for the results' names: h100, h200, ... (gpu where nvidia-smi does not say)
    local name
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE '[ahlb][0-9]+[a-z]*' | head -1 || true)
    echo "${name,,}" | grep . || echo gpu
}

bench_long() {
    environment
    local n=${1:?bench-long needs N (conversations) and SECONDS} seconds=${2:?bench-long needs SECONDS}
    shift 2
    python -m bench.run --url localhost:8001 --name "$(gpu_slug)-n$n-${seconds}s" \
        --stages load --conversations "$n" --seconds "$seconds" --persona-every 30 --trace-dir "$TRACE_DIR" "$@"
}

stop() {
    if [ -f "$HOST/tritonserver.pid" ]; then
        local group=-$(cat "$HOST/tritonserver.pid")
        kill -TERM -- "$group" 2>/dev/null || true
        # The launcher drains and exits within its SHUTDOWN_BOUND_S (40 s; serving/launch.py).
        for _ in $(seq 45); do kill -0 -- "$group" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "$group" 2>/dev/null || true
        rm -f "$HOST/tritonserver.pid"
    fi
    # tritonserver runs in a process group of its own (the launcher's SIGTERM drains it), and a
    # server that crashed leaves its Python-backend stubs behind, holding the GPU's memory.
    pkill -KILL -f tritonserver/bin/tritonserver 2>/dev/null || true
    pkill -KILL -f triton_python_backend_stub 2>/dev/null || true
}

engine() {  # issue 10's table: the talker tick beside moshi's LMGen, in one session
    environment
    local out=${1:-bench/results} tokenizer
    tokenizer=$(find "$CHECKPOINT" checkpoints/tiny -maxdepth 1 -name 'tokenizer*.model' 2>/dev/null | head -1 || true)
    python bench/gpu_step.py --tokenizer "$tokenizer" --slots 1 16 64 128 --fill 3000 \
        --kv-dtype bfloat16 float8_e4m3fn --weight-dtype bfloat16 float8_e4m3fn --agreement-frames 200 --out "$out"
    python -m bench.moshi_anchor --batch 1 8 32 64 --out "$out/moshi_anchor.json"
    python bench/gpu_step.py --from-json "$out/gpu_step.json" --anchor "$out/moshi_anchor.json" --out "$out"
}

profile() {  # py-spy of one stage's stub at load: every thread with idle time, and the GIL's holder
    environment
    local stage=${1:?profile needs STAGE (talker or code2wav), SECONDS and DIR} seconds=${2:?} out=${3:?} pid
    command -v py-spy > /dev/null || { echo "no py-spy here: carry $BUNDLE/tools.tar.xz and run" \
        "'scripts/gpu_host.sh install tools'" >&2; exit 1; }
    # the stub's command line names its model: .../talker/1/model.py
    pid=$(pgrep -f "triton_python_backend_stub.*/$stage/1/model.py" | head -1) || true
    [ -n "$pid" ] || { echo "no $stage stub is running" >&2; exit 1; }
    mkdir -p "$out"
    # --nonblocking: the stub is not stopped to be read, so the run's latencies still count;
    # both records run at once, over the same seconds
    py-spy record -p "$pid" -d "$seconds" -r 200 --nonblocking --idle --threads -f raw \
        -o "$out/$stage-threads.txt" > /dev/null &
    py-spy record -p "$pid" -d "$seconds" -r 200 --nonblocking --gil --threads -f raw \
        -o "$out/$stage-gil.txt" > /dev/null
    wait
    # one compressed file: the device tool left the two raw files out of what it brought back
    tar -C "$out" --remove-files -cJf "$out/$stage-pyspy.tar.xz" "$stage-threads.txt" "$stage-gil.txt"
}

case "${1:-}" in
    bundle) bundle ;;
    install) shift; install "$@" ;;
    checkpoint) checkpoint ;;
    test) gpu_tests ;;
    test-library) environment; python -m pytest -q -rs tests/test_gpu.py tests/test_fp8_weights.py ;;
    serve) shift; serve "$@" ;;
    bench) shift; bench "$@" ;;
    bench-long) shift; bench_long "$@" ;;
    engine) engine "${2:-}" ;;
    profile) shift; profile "$@" ;;
    traces) mkdir -p "${2:?traces needs a folder}"  # the frame and prefill traces and the server's log
        tar -C "$(dirname "$TRACE_DIR")" -cf - "$(basename "$TRACE_DIR")" tritonserver.log | xz -T0 -6 > "$2/trace.tar.xz" ;;
    run) shift; environment; "$@" ;;
    stop) stop ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
