# syntax=docker/dockerfile:1
#
# tokenwire server image (docs/operations.md, "Container image").
#
#   docker build -t tokenwire:0.1.0 .                          # the default model baked in
#   docker build --build-arg BAKE_MODEL=0 -t tokenwire:0.1.0 . # no model: mount the cache as a volume
#   docker run --gpus all --stop-timeout 40 -p 50051:50051 -p 9090:9090 tokenwire:0.1.0
#
#   docker build --build-arg ENGINE=vllm -t tokenwire:0.1.0-vllm .   # vLLM as the engine
#   docker run --gpus all --shm-size 8g --stop-timeout 40 -p 50051:50051 -p 9090:9090 tokenwire:0.1.0-vllm
#
# Stages. `python` is the CUDA base plus the distribution's Python; `builder` and
# `runtime` both start from it (`runtime` through `runtime-batched` or `runtime-vllm`),
# so the interpreter the venv points at (/usr/bin/python3) is the same file at the
# same path in both. `builder` installs the package with the Makefile targets CI runs;
# `runtime` gets the venv and the converted model, never make, pip or caches, and in
# the default (batched) image no compiler either.
#
# ENGINE picks the engine the image is built for (docs/operations.md, "vLLM engine"):
#   batched (default)  `make setup`: tokenwire's own engines (batched, simple) on torch;
#                      the same build as before ENGINE existed.
#   vllm               `make setup-vllm`: the CUDA `vllm` package from PyPI, which brings
#                      its own CUDA torch, into the same /opt/tokenwire venv; the image
#                      sets TOKENWIRE_ENGINE=vllm. Its runtime starts from `runtime-vllm`,
#                      which adds what vLLM needs at run time and the batched image must
#                      not have: a C compiler and Python's headers (below). Run it with
#                      shared memory for vLLM's workers (--shm-size or --ipc=host).
#
# The batched image takes torch's CUDA 12.8 build (TORCH_CUDA=cu128, from PyTorch's wheel
# index: the Makefile's TORCH_CUDA), which brings its own CUDA libraries (cuBLAS, cuDNN,
# NCCL) as wheels, so the CUDA `base` flavour (the driver hooks and NVIDIA_* variables the
# container toolkit reads) is enough: a `runtime` or `cudnn-runtime` base would add a second
# copy of the same libraries. CUDA 12.8 runs on drivers from 525 on (minor-version
# compatibility; clusters commonly run 535 or 550), where a 13.0 base makes the container
# toolkit refuse any driver before 580. Keep BASE_IMAGE's CUDA line equal to TORCH_CUDA's.
# ENGINE=vllm installs the torch that vllm pins instead: keep BASE_IMAGE's CUDA line no
# newer than that torch's (the container toolkit checks the host driver against BASE_IMAGE's).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
# batched or vllm. Declared before the first FROM so that it can name the runtime's base.
ARG ENGINE=batched

FROM ${BASE_IMAGE} AS python
SHELL ["/bin/bash", "-eu", "-o", "pipefail", "-c"]
# An ARG, not an ENV: it must not stay set in the image.
ARG DEBIAN_FRONTEND=noninteractive
# DL3008 (pin apt versions): the base image tag pins the distribution release; pinning
# exact Ubuntu package versions breaks the build as soon as the archive drops them.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*

FROM python AS builder
ARG DEBIAN_FRONTEND=noninteractive
# DL3008: as above.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-venv make g++ \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Makefile pyproject.toml constraints.txt README.md ./
COPY client ./client
COPY service ./service
# EXTRAS=server,gpu: the model stack, and nvidia-ml-py for the NVML gauges (GPU busy, memory
# used by every process) and the driver version in the start-up log; on a host without a
# driver it finds none and the server goes without them.
# torch's CUDA line (above). A CPU-only image sets TORCH_CUDA="" and points TORCH_INDEX_URL
# at a CPU wheel index (docs/operations.md, "CPU-only image"). Not used by ENGINE=vllm.
ARG TORCH_CUDA=cu128
ARG TORCH_INDEX_URL=""
ARG ENGINE
# ENGINE=vllm: `make setup-vllm` into the same venv path, so `make model` below (VENV=
# /opt/tokenwire, whose stamp file is the one setup-vllm writes) and the runtime stage
# see one venv either way. HAS_GPU=1 because no GPU is visible during `docker build`:
# without it the target would take the CPU branch (a separate torch install and the
# removal of torchvision/torchaudio/torchcodec, which the CUDA vllm package needs).
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=cache,target=/root/.cache/uv \
    case "${ENGINE}" in \
      batched) make setup VENV=/opt/tokenwire EXTRAS=server,gpu EDITABLE= TORCH_CUDA="${TORCH_CUDA}" TORCH_INDEX_URL="${TORCH_INDEX_URL}" ;; \
      vllm) make setup-vllm VLLM_VENV=/opt/tokenwire VLLM_PACKAGE=vllm VLLM_EXTRAS=server,gpu EDITABLE= HAS_GPU=1 ;; \
      *) echo "ENGINE must be batched or vllm, not '${ENGINE}'" >&2; exit 1 ;; \
    esac
# BAKE_MODEL=1 converts MODEL into the image's cache once, at build time, so a
# container starts without converting; BAKE_MODEL=0 leaves the cache empty for a volume.
ARG BAKE_MODEL=1
ARG MODEL=default
# DL3064 (sensitive data in ENV): a false positive on the product name; TOKENWIRE_*
# variables here hold paths and ports, never secrets (those are files: --auth-token-file).
# hadolint ignore=DL3064
ENV TOKENWIRE_CACHE_DIR=/var/cache/tokenwire \
    TOKENWIRE_KERNEL_DIR=/var/cache/tokenwire/kernels
RUN mkdir -p "${TOKENWIRE_CACHE_DIR}" \
 && if [ "${BAKE_MODEL}" = "1" ]; then \
      make model VENV=/opt/tokenwire EXTRAS=server,gpu EDITABLE= MODEL="${MODEL}"; \
    fi
# The batched engine's compiled CPU ops (engine/kernels), compiled here (g++ stays in this
# stage): the runtime has no compiler, and finds them built under TOKENWIRE_KERNEL_DIR,
# which is inside the cache directory the runtime copies. The build needs g++ only, not
# an AVX2 CPU on the build machine. On a platform that cannot build them (an arm64
# image) `make kernels` says why and exits 0, and the server runs stock torch ops there.
RUN if [ "${ENGINE}" = "batched" ]; then \
      make kernels VENV=/opt/tokenwire EXTRAS=server,gpu EDITABLE=; \
    fi

# The runtime's base, by ENGINE. BuildKit builds only the one `runtime` names.
FROM python AS runtime-batched

FROM python AS runtime-vllm
ARG DEBIAN_FRONTEND=noninteractive
# vLLM compiles kernels when it starts: torch.compile (Inductor) and Triton build each
# kernel's launcher with a C compiler against Python's headers, and fail with "Failed to
# find C compiler" without them. gcc, libc6-dev (crt files, libc headers) and
# python3-dev only; still no make, pip or venv tooling.
# DL3008: as above.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev python3-dev \
 && rm -rf /var/lib/apt/lists/*

# DL3006 (tag the image's version): runtime-${ENGINE} is a stage of this file
# (runtime-batched or runtime-vllm), not an image from a registry; hadolint cannot
# resolve the variable to see that.
# hadolint ignore=DL3006
FROM runtime-${ENGINE} AS runtime
ARG ENGINE
LABEL org.opencontainers.image.title="tokenwire" \
      org.opencontainers.image.description="Streams a language model's answer token by token over gRPC (tokenwire.v1.TextGeneration)" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed numeric UID/GID, so that Kubernetes' runAsNonRoot can verify it.
RUN groupadd --system --gid 10001 tokenwire \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/tokenwire --create-home \
      --shell /usr/sbin/nologin tokenwire
COPY --from=builder /opt/tokenwire /opt/tokenwire
# Owned by the server's user: `docker run` may convert other models into it.
COPY --from=builder --chown=10001:10001 /var/cache/tokenwire /var/cache/tokenwire
# DL3064: as above.
# hadolint ignore=DL3064
ENV PATH=/opt/tokenwire/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TOKENWIRE_HOST=0.0.0.0 \
    TOKENWIRE_PORT=50051 \
    TOKENWIRE_METRICS_PORT=9090 \
    TOKENWIRE_LOG_FORMAT=json \
    TOKENWIRE_CACHE_DIR=/var/cache/tokenwire \
    TOKENWIRE_KERNEL_DIR=/var/cache/tokenwire/kernels \
    TOKENWIRE_ENGINE=${ENGINE}
USER 10001:10001
WORKDIR /home/tokenwire
EXPOSE 50051 9090
# Healthy = ready to take calls: the readiness service, NOT_SERVING while the model
# loads and from the first moment of a drain. Through sh so that a changed
# TOKENWIRE_PORT is followed; `|| exit 1` because Docker reserves every status but
# 0 and 1. Plaintext only: with --tls-cert, rely on the
# orchestrator's probes (docs/operations.md, "Health").
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
  CMD ["/bin/sh", "-c", "tokenwire health --target 127.0.0.1:${TOKENWIRE_PORT} --service tokenwire.v1.TextGeneration --timeout 3 || exit 1"]
# The server drains on SIGTERM: readiness NOT_SERVING, new calls UNAVAILABLE, streams
# in flight finish within --grace-period (25 s), then it exits 0. Allow longer than
# that before the kill: `docker stop -t 40`, terminationGracePeriodSeconds: 40.
STOPSIGNAL SIGTERM
# Exec form: the server is PID 1 and receives the signal itself.
ENTRYPOINT ["tokenwire-server"]
