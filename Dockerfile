# One image for every Tandem service; compose.yaml picks the service with its command.
# CPU build by default. For NVIDIA GPUs build FROM a CUDA runtime image and install the
# matching CUDA torch wheel instead (TORCH_INDEX=https://download.pytorch.org/whl/cu128).
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 UCX_WARN_UNUSED_ENV_VARS=n

WORKDIR /app
COPY pyproject.toml README.md ./
COPY common ./common
COPY devtools ./devtools
COPY kernels ./kernels
COPY services ./services
RUN pip install --index-url "$TORCH_INDEX" torch==2.13.0 \
 && pip install .

# Services run as an unprivileged user.
RUN useradd --create-home tandem
USER tandem
