#!/usr/bin/env bash
# The container's server: a model repository for this host's GPUs (one `speech` instance per GPU,
# both stages in one Python stub, pools sized by the environment: on GPUs one stub has held more
# than two, docs/deployment.md; PERSONAPLEX_ONE_STUB=0: one talker and one code2wav instance per
# GPU), then tritonserver with the secure defaults.
set -euo pipefail
repository=/srv/model_repository
if [[ ${PERSONAPLEX_ONE_STUB:-1} == 1 ]]; then
    layout=(--one-stub) talker_pool=speech.max_conversations decoder_pool=speech.code2wav_conversations
else
    layout=() talker_pool=talker.max_conversations decoder_pool=code2wav.max_conversations
fi
python3 -m personaplex_triton.serving.model_configs "${layout[@]}" --out "$repository" \
    --gpus "${PERSONAPLEX_GPUS:-all}" \
    --set "$talker_pool=${TALKER_CONVERSATIONS:-64}" \
    --set "$decoder_pool=${CODE2WAV_CONVERSATIONS:-72}"
# PERSONAPLEX_ADMIN_KEY restricts the admin APIs (launch.py); without it they stay open.
exec python3 -m personaplex_triton.serving.launch --model-repository "$repository"
