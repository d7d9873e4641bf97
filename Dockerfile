# syntax=docker/dockerfile:1
#
# featpool: HTTP feature encoder with a shared CUDA VMM pool.
#
#   docker build -t featpool:0.1.0 .
#   docker run --gpus all -p 8000:8000 -v /run/featpool:/run/featpool featpool:0.1.0
#
# Two stages on the same CUDA runtime base, so the virtual environment built in the first stage
# finds the very same /usr/bin/python3 in the second. Ubuntu 24.04 ships Python 3.12, which
# pyproject's requires-python accepts (22.04's 3.10 does not; tests/test_helm.py checks this). The torch wheel brings its own CUDA user
# libraries; the GPU driver comes from the host through the NVIDIA container toolkit.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS builder

ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --upgrade pip

WORKDIR /src
# Only what the wheel needs: the metadata (pyproject.toml names README.md) and the two packages.
COPY pyproject.toml README.md ./
COPY app ./app
COPY pool ./pool
# The engine integrations (docs/integrations.md): small, and part of the package.
COPY featpool_vllm ./featpool_vllm
COPY featpool_sglang ./featpool_sglang
RUN /opt/venv/bin/pip install ".[cuda]" \
 && /opt/venv/bin/pip check \
 && /opt/venv/bin/python -c "import app, pool"

# ---------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS runtime

ARG DEBIAN_FRONTEND=noninteractive
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

LABEL org.opencontainers.image.title="featpool" \
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
