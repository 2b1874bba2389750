#!/usr/bin/env bash
# The container's server: a model repository for this host's GPUs (one talker and one code2wav
# instance per GPU, pools sized by the environment), then tritonserver with the secure defaults.
set -euo pipefail
repository=/srv/model_repository
python3 -m personaplex_triton.serving.model_configs --out "$repository" --gpus "${PERSONAPLEX_GPUS:-all}" \
    --set "talker.max_conversations=${TALKER_CONVERSATIONS:-64}" \
    --set "code2wav.max_conversations=${CODE2WAV_CONVERSATIONS:-72}"
# PERSONAPLEX_ADMIN_KEY restricts the admin APIs (launch.py); without it they stay open.
exec python3 -m personaplex_triton.serving.launch --model-repository "$repository"
