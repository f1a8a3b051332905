# kvstack: the two commands a newcomer runs are `make demo` and `make test` (see README.md).
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYTHONHASHSEED ?= 0

.PHONY: help demo test env fetch apply check doctor matrix matrix-apply lint-docker image-cpu image-cuda clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 18

demo: env ## THE MAIN JOB: fetch + verify + patch + build the CPU env, then kvstack vs upstream vLLM side by side
	$(VENV)/bin/kvstack demo

test: env matrix-apply ## THE TESTS: apply matrix, tooling, patch, engine tests, upstream's suite (what .ci/run runs)
	$(PY) -m pytest tests -q -p no:cacheprovider --timeout=1200 --junitxml=build/junit/tests.xml

matrix-apply: ## the cheap pass of the regression matrix: does each patch apply to each listed release?
	python3 ci/run_matrix.py --suites apply --no-png --out build/matrix

# The pinned cell's unit results come from the last `make test` (its junit file), when there is one.
MATRIX_ARGS ?= $(if $(wildcard build/junit/tests.xml),--results unit=build/junit/tests.xml)
matrix: ## the whole regression matrix, published to ci/REPORT.md and ci/matrix.png
	python3 ci/run_matrix.py --publish $(MATRIX_ARGS)

env: fetch apply ## build the CPU environment ($(VENV)) with the stack applied; idempotent
	KVSTACK_VENV=$(VENV) scripts/build_env.sh

fetch: ## download (cached), verify sha256 and unpack the pinned sdists into vllm/upstream, lmcache/upstream
	scripts/fetch_sources.sh

apply: fetch ## apply the patch stack to the fetched trees (all-or-nothing, idempotent)
	scripts/apply_patches.sh

check: fetch ## report each patch's state against the fetched trees; changes nothing
	scripts/apply_patches.sh --check

doctor: ## pinned versions and every patch's state in $(VENV)
	$(VENV)/bin/kvstack doctor

lint-docker: ## lint the Dockerfile with hadolint (from the package registry, sha256-pinned)
	ci/hadolint.sh

# Image builds: BUILDER=docker|podman|buildah (default: detected), BASE=IMAGE, CA_CERT=FILE (see README).
IMAGE_ARGS = $(if $(BUILDER),--builder $(BUILDER)) $(if $(BASE),--base $(BASE)) $(if $(CA_CERT),--ca-cert $(CA_CERT))
image-cpu: ## build the cpu image (Docker with BuildKit, Podman or Buildah; BUILDER=, BASE=, CA_CERT=)
	scripts/docker_build.sh --target cpu $(IMAGE_ARGS)

image-cuda: ## build the cuda image (Docker with BuildKit, Podman or Buildah; BUILDER=, BASE=, CA_CERT=)
	scripts/docker_build.sh --target cuda $(IMAGE_ARGS)

clean: ## remove the venv, fetched trees and build outputs (the download cache stays)
	rm -rf $(VENV) vllm/upstream lmcache/upstream build
