# syntax=docker/dockerfile:1
#
# featpool: HTTP feature encoder with a shared CUDA VMM pool.
#
#   docker build -t featpool:0.1.0 .                                          # CUDA 12.8
#   docker build --build-arg CUDA_VERSION=13.0.0 -t featpool:0.1.0-cuda13.0 .  # CUDA 13.0
#   sudo install -d -m 1770 -o 10001 -g 10001 /run/featpool  # the socket directory, the image's uid
#   docker run --gpus all -p 8000:8000 -v /run/featpool:/run/featpool featpool:0.1.0
#
# (Docker would create a missing /run/featpool root-owned, where the service, uid 10001, cannot
# make its socket: start-up then fails with a PermissionError naming the socket's lock file.)
#
# One build argument, CUDA_VERSION, picks both the base image (nvidia/cuda:<CUDA_VERSION>-runtime)
# and the lock file requirements/cuda-<major.minor>.txt: torch, torchvision and cuda-bindings
# built for that CUDA release, every dependency pinned with its hashes, the `cuda` and `hf`
# extras included. CUDA 12.8 needs an R570 or newer driver on the nodes, CUDA 13.0 an R580.
# The dependencies are a layer of their own, installed before the source is copied: a source
# change reuses it. `make lock` regenerates the locks (uv pip compile --generate-hashes).
#
# Two stages on the same base, so the virtual environment built in the first stage finds the
# very same /usr/bin/python3 in the second. Ubuntu 24.04 ships Python 3.12, which pyproject's
# requires-python accepts and the locks are compiled for (tests/test_image.py checks both). The
# torch wheel brings its own CUDA user libraries of the same release as the base image; the GPU
# driver comes from the host through the NVIDIA container toolkit.

ARG CUDA_VERSION=12.8.1

# ---------------------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04 AS builder

ARG CUDA_VERSION
ARG DEBIAN_FRONTEND=noninteractive
# Ubuntu's archive drops a package version once it is superseded, so an apt pin breaks the build at
# the next security update (DL3008); the base image tag and the lock file are what is pinned.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*

ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv

WORKDIR /src
# The locked dependencies of this CUDA release, hashes required, nothing resolved at build time.
COPY requirements/ ./requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/venv/bin/pip install --require-hashes --no-deps -r "requirements/cuda-${CUDA_VERSION%.*}.txt"

# Then the project alone: no dependencies, and no build backend fetched (hatchling is locked).
# Only what the wheel needs: the metadata (pyproject.toml names README.md) and the packages.
COPY pyproject.toml README.md ./
COPY app ./app
COPY pool ./pool
# The engine integrations (docs/integrations.md): small, and part of the package.
COPY featpool_vllm ./featpool_vllm
COPY featpool_sglang ./featpool_sglang
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps --no-build-isolation . \
 && /opt/venv/bin/pip check \
 && /opt/venv/bin/python -c "import app, pool, torchvision, transformers, cuda.bindings.driver"

# ---------------------------------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04 AS runtime

ARG DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# A fixed numeric UID/GID so Kubernetes can verify runAsNonRoot without reading /etc/passwd,
# and so consumer pods can be given the same group for the hand-off socket.
RUN groupadd --system --gid 10001 featpool \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/featpool --create-home \
      --shell /usr/sbin/nologin featpool \
 && mkdir -p /run/featpool \
 && chown 10001:10001 /run/featpool \
 && chmod 0770 /run/featpool

COPY --from=builder /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    XDG_CACHE_HOME=/tmp/.cache \
    FEATPOOL_SOCKET_PATH=/run/featpool/featpool.sock

ARG CUDA_VERSION
LABEL org.opencontainers.image.title="featpool" \
      com.nvidia.cuda.version.base="${CUDA_VERSION}" \
      org.opencontainers.image.description="Encode images to GPU feature tensors and hand them to other processes zero-copy" \
      org.opencontainers.image.licenses="Apache-2.0"

USER 10001:10001
WORKDIR /home/featpool
EXPOSE 8000

# No curl in the image: python's urllib. urlopen raises on 4xx/5xx and on refused connections,
# so any failure exits non-zero. The start period covers the model load.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('FEATPOOL_PORT', '8000') + '/health/live', timeout=4)"]

ENTRYPOINT ["python", "-m", "app"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
