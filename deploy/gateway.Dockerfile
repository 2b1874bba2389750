# The WebSocket gateway alone (src/personaplex_gateway/): no torch, no Triton, no GPU. It reaches
# Triton over gRPC (--triton-url) and reads the voices from the checkpoint folder mounted at
# /checkpoint (or takes --voices). Built from the repository's root:
#   docker build -f deploy/gateway.Dockerfile -t personaplex-gateway .
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONPATH=/opt/personaplex-gateway
WORKDIR /opt/personaplex-gateway

# The client package (numpy, tritonclient[grpc]) and the gateway's own pins, as in pyproject.toml.
COPY client ./client
RUN pip install ./client "aiohttp==3.14.5" "sphn==0.2.1" "numpy==1.26.4"
COPY src/personaplex_gateway ./personaplex_gateway

RUN useradd --system --uid 10001 --no-create-home gateway
USER 10001
EXPOSE 8080
ENTRYPOINT ["python", "-m", "personaplex_gateway", "--host", "0.0.0.0", "--port", "8080"]
CMD ["--triton-url", "triton:8001", "--checkpoint", "/checkpoint"]
