#!/usr/bin/env bash
# The patch round trip, import half (see kvstack/release/roundtrip.py). Run with --help.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -c 'import sys; from kvstack.release.roundtrip import main_import; sys.exit(main_import())' "$@"
