# PersonaPlex served by NVIDIA's Triton image on a GPU host: the project and its Python
# dependencies installed into that image's Python, which runs the Python backend's models.
# 24.12: tritonserver 2.53, Ubuntu 24.04, Python 3.12, CUDA 12.6. Its Python backend takes
# numpy 2 (python_backend PR 384, 2024-10), so the numpy<2 pin of the CPU build does not apply.
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.12-py3
FROM ${TRITON_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The image's Python is the system one (PEP 668); it is this container's only Python.
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_NO_CACHE_DIR=1 \
    NO_TORCH_COMPILE=1 \
    PERSONAPLEX_EXPORT_DIR=/artefacts/mimi
WORKDIR /opt/personaplex-triton

# Dependencies first (a layer that outlives code edits): pyproject.toml's own pins, less those
# of the CPU build (numpy<2 and the tritonserver of nvidia-pytriton); the export extra (ONNX)
# and TensorRT's Python package, matching the image's TensorRT 10.7, for the engines.
COPY pyproject.toml ./
RUN python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(d for d in p['dependencies'] + p['optional-dependencies']['export'] \
if not d.startswith(('numpy', 'nvidia-pytriton'))))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt "tensorrt==10.7.*" \
    && pip install --no-deps moshi==0.2.13

COPY README.md ./
COPY src ./src
COPY client ./client
COPY export ./export
COPY model_repository ./model_repository
COPY model_repository_one_stub ./model_repository_one_stub
COPY deploy/serve.sh ./deploy/serve.sh
RUN pip install --no-deps -e .

EXPOSE 8000 8001 8002
CMD ["deploy/serve.sh"]
