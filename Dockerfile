# The stepahead image: gateway, scheduler and worker (docker-compose.yml, deploy/kubernetes/).
#
# torch: the CPU build by default (TORCH_INDEX, pytorch.org's CPU wheel index), enough for
# gateways (no torch used), schedulers (no torch used) and CPU workers. A CUDA worker needs a
# CUDA build of the same torch, from another index:
#   docker build -t stepahead:dev .                                              # CPU (default)
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t stepahead:cuda .
# The image records which one it holds (`docker inspect` label org.stepahead.torch-index).
FROM python:3.11-slim
ARG TORCH=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Structured outputs (worker): xgrammar without its declared triton dependency (~1 GB of GPU
# kernels stepahead does not use), as the Makefile installs it; its other dependencies are
# in pyproject.toml.
ARG XGRAMMAR=xgrammar==0.2.8
LABEL org.stepahead.torch="$TORCH" org.stepahead.torch-index="$TORCH_INDEX"
WORKDIR /app
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "$TORCH" \
    && pip install --no-cache-dir --no-deps "$XGRAMMAR"
# .dockerignore keeps the virtual environment, .git, caches and benchmark plots out of the context
COPY . .
RUN pip install --no-cache-dir . \
    && python -c "import torch, xgrammar, stepahead; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
