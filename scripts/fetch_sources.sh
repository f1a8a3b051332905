#!/usr/bin/env bash
# Download the pinned vLLM/LMCache sdists (cached), verify sha256, unpack into {vllm,lmcache}/src/<base>/
# (git-ignored).
# Run with --help for options and exit codes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m kvstack.release.fetch "$@"
