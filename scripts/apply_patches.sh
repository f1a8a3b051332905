#!/usr/bin/env bash
# Apply the patch stack all-or-nothing. Run with --help for targets, options and exit codes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m kvstack.release.patchstack "$@"
