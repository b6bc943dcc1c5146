# syntax=docker/dockerfile:1
# mmserve on NVIDIA GPUs. Build:  docker build -t mmserve .
# Run:    docker run --gpus all -p 8000:8000 -p 8001:8001 -v /srv/models:/models mmserve /models/llava-1.5-7b-hf
#         (the argument is a checkpoint directory or a hub model ID; none serves the embedded demo model).
# docs/deploy.md has the volumes, HF_TOKEN, offline use and a Kubernetes Deployment. CPU only: Dockerfile.cpu.
# Installs through the lock (constraints.txt) with the same pip commands as `make install`.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# PyPI's torch 2.14.1 for x86_64 is a CUDA 13.0 build (its CUDA libraries come as wheels): the host needs an
# NVIDIA driver >= 580. Another CUDA: --build-arg TORCH_SPEC=... with a matching --build-arg CUDA_IMAGE=...
ARG TORCH_SPEC="torch==2.14.1 torchvision==0.29.1"

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/mmserve \
    PATH=/opt/mmserve/bin:$PATH \
    HF_HOME=/cache/huggingface

# python3 (3.12 on Ubuntu 24.04), gcc and the Python headers (Triton compiles its kernel launchers at run time),
# tini as PID 1 (passes SIGTERM on to the server and reaps tensor-parallel workers).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev tini ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/mmserve

WORKDIR /opt/mmserve-src
# torch first: its layer stays cached while the code changes.
COPY constraints.txt ./
RUN pip install -c constraints.txt --upgrade pip \
 && pip install -c constraints.txt ${TORCH_SPEC}
COPY pyproject.toml README.md ./
COPY mmserve ./mmserve
RUN pip install -c constraints.txt . \
 && cd / && rm -rf /opt/mmserve-src

# A non-root user; /models and the hub cache are its own (mount volumes there).
RUN useradd --create-home --uid 10001 --user-group mmserve \
 && mkdir -p /models /cache/huggingface \
 && chown -R 10001:10001 /models /cache
USER 10001
WORKDIR /home/mmserve

EXPOSE 8000 8001
# SIGTERM drains: readiness turns 503, requests in flight finish within --exit-timeout-secs (default 30), exit 0.
STOPSIGNAL SIGTERM
# Loading a 7B model (and capturing CUDA graphs) takes minutes: failures only count after the start period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=4)" || exit 1
ENTRYPOINT ["tini", "--", "mmserve", "serve", "--host", "0.0.0.0", "--http-port", "8000", "--grpc-port", "8001"]
# The model: a checkpoint directory (e.g. under /models) or a hub model ID, then any other `mmserve serve` flags.
CMD []
