#!/usr/bin/env bash
# The container's server: a model repository for this host's GPUs (one `speech` instance per GPU,
# both stages in one Python stub, pools sized by the environment: on GPUs one stub has held more
# than two, docs/deployment.md; PERSONAPLEX_ONE_STUB=0: one talker and one code2wav instance per
# GPU), then tritonserver with the secure defaults. PERSONAPLEX_GPUS=none: one instance on the CPU
# (deploy/cpu.Dockerfile's image); TRITON_HTTP_PORT, TRITON_GRPC_PORT, TRITON_METRICS_PORT move the
# ports from 8000, 8001, 8002 (a container on the host's network).
set -euo pipefail
repository=/srv/model_repository
if [[ ${PERSONAPLEX_ONE_STUB:-1} == 1 ]]; then
    layout=(--one-stub) talker_pool=speech.max_conversations decoder_pool=speech.code2wav_conversations
else
    layout=() talker_pool=talker.max_conversations decoder_pool=code2wav.max_conversations
fi
if [[ ${PERSONAPLEX_GPUS:-all} == none ]]; then
    instances=(--cpu-instances 1)
else
    instances=(--gpus "${PERSONAPLEX_GPUS:-all}")
fi
python3 -m personaplex_triton.serving.model_configs "${layout[@]}" --out "$repository" "${instances[@]}" \
    --set "$talker_pool=${TALKER_CONVERSATIONS:-64}" \
    --set "$decoder_pool=${CODE2WAV_CONVERSATIONS:-72}"
# PERSONAPLEX_ADMIN_KEY restricts the admin APIs (launch.py); without it they stay open.
exec python3 -m personaplex_triton.serving.launch --model-repository "$repository" \
    --http-port "${TRITON_HTTP_PORT:-8000}" --grpc-port "${TRITON_GRPC_PORT:-8001}" \
    --metrics-port "${TRITON_METRICS_PORT:-8002}"
