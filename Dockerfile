# One image for every Tandem service; compose.yaml and the Helm chart (deploy/helm/tandem,
# image `tandem:<appVersion>`) pick the service with its command.
#
#   docker build -t tandem:0.1.0 .                                  # CPU (torch from the CPU index)
#   docker build -t tandem:0.1.0-cu128 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .   # NVIDIA GPUs
#
# The CUDA torch wheels carry their CUDA libraries; the NVIDIA container toolkit on the node
# provides the driver, so the GPU image needs no CUDA base image.
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 UCX_WARN_UNUSED_ENV_VARS=n

# g++ builds Tandem's C++ CPU kernels (and Triton's launchers on GPU); without it CPU
# workers fall back to plain torch ops.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY common ./common
COPY devtools ./devtools
COPY kernels ./kernels
COPY services ./services
# As the Makefile: torch pinned first (from the chosen index), then the project.
RUN pip install --index-url "$TORCH_INDEX" torch==2.13.0 \
 && pip install .

# Services run as an unprivileged user (uid 1000, as the chart's securityContext). The CPU
# kernels are built now, into /app/.tandem, which that user owns.
RUN useradd --create-home --uid 1000 tandem \
 && (python -m kernels.cpu_ops || echo "C++ CPU kernels unavailable: workers use the torch fallback") \
 && mkdir -p .tandem && chown -R tandem .tandem
USER tandem
