# PersonaPlex on a CPU-only machine: Triton 2.51 of the nvidia-pytriton wheel, torch's CPU build,
# the Python 3.11 of Debian bookworm. No registry is needed: the base is a bookworm root file
# system imported into the engine (scripts/container_test.py makes it: debootstrap, docker import)
# and every Python package is a wheel in the build context's build/wheels/ (pip download on the
# host: torch's CPU wheel, never a CUDA build). Built from the repository's root:
#   make container-image        # the base, the wheels and this image, tagged personaplex-triton-cpu
# The GPU image is ../Dockerfile, on NVIDIA's Triton image.
#
# The storage driver may be vfs (an engine inside a container), which stores every layer as a
# full copy of the file system: so few instructions, the metadata ones before the large layers,
# and the project's files gathered in a stage of their own.
ARG BASE_IMAGE=personaplex-bookworm:latest

# The project's files alone, where the image has them (no base: its layers hold only them); the
# .pth puts its packages on the venv's path, the Python backend's stubs' included.
FROM scratch AS source
COPY src /opt/personaplex-triton/src
COPY client /opt/personaplex-triton/client
COPY export /opt/personaplex-triton/export
COPY model_repository /opt/personaplex-triton/model_repository
COPY model_repository_one_stub /opt/personaplex-triton/model_repository_one_stub
COPY deploy/serve.sh /opt/personaplex-triton/deploy/serve.sh
COPY deploy/personaplex-triton.pth /opt/venv/lib/python3.11/site-packages/

# The dependencies in a venv, from the wheels only: pyproject.toml's pins with the export extra
# (the export service's ONNX) and the gateway extra, then moshi without its torch<2.10 pin.
FROM ${BASE_IMAGE} AS venv
COPY build/wheels /wheels
COPY pyproject.toml /wheels/
RUN python3 -c "import tomllib; p = tomllib.load(open('/wheels/pyproject.toml', 'rb'))['project']; \
extras = p['optional-dependencies']; \
print('\n'.join(p['dependencies'] + extras['export'] + extras['gateway']))" > /wheels/requirements.txt \
    && python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /wheels -r /wheels/requirements.txt \
    && /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /wheels --no-deps moshi==0.2.13 \
    && /opt/venv/bin/python -c "import torch; assert torch.version.cuda is None, torch.__version__"

FROM ${BASE_IMAGE}
# The venv's python first on PATH: the Python backend's stub runs `python3` from there.
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    NO_TORCH_COMPILE=1 \
    PERSONAPLEX_EXPORT_DIR=/artefacts/mimi \
    PERSONAPLEX_GPUS=none
CMD ["/opt/personaplex-triton/deploy/serve.sh"]
COPY --from=venv /opt/venv /opt/venv
COPY --from=source /opt /opt
