#!/usr/bin/env bash
# The container's server: a model repository for this host's GPUs (one talker and one code2wav
# instance per GPU, pools sized by the environment; PERSONAPLEX_ONE_STUB=1: one `speech` instance
# per GPU, both stages in one Python stub), then tritonserver with the secure defaults.
set -euo pipefail
repository=/srv/model_repository
if [[ ${PERSONAPLEX_ONE_STUB:-0} == 1 ]]; then
    python3 -m personaplex_triton.serving.model_configs --one-stub --out "$repository" \
        --gpus "${PERSONAPLEX_GPUS:-all}" \
        --set "speech.max_conversations=${TALKER_CONVERSATIONS:-64}" \
        --set "speech.decoder_conversations=${CODE2WAV_CONVERSATIONS:-72}"
else
    python3 -m personaplex_triton.serving.model_configs --out "$repository" --gpus "${PERSONAPLEX_GPUS:-all}" \
        --set "talker.max_conversations=${TALKER_CONVERSATIONS:-64}" \
        --set "code2wav.max_conversations=${CODE2WAV_CONVERSATIONS:-72}"
fi
# PERSONAPLEX_ADMIN_KEY restricts the admin APIs (launch.py); without it they stay open.
exec python3 -m personaplex_triton.serving.launch --model-repository "$repository"
