#!/usr/bin/env bash
# Check, before anything is installed, that an interpreter the pinned wheels need is there and can
# make a venv. The image's cpu stage runs it first on its base image (a base without Python 3.11 fails
# in seconds, naming what is missing); scripts/install_image.sh runs it too.
#
#   scripts/check_python.sh [--base NAME] PYTHON   e.g. python3.11 (a name looked up on PATH) or /usr/bin/python3.11
#
# --base NAME  the kvstack base whose pinned torch wheel the message names (default $KVSTACK_BASE, else
#              vllm/default; the message leaves it out when the base's pin file is not there).
# Exit codes: 0 ok, 2 missing (the message says what: the interpreter, or its venv/ensurepip module).
set -euo pipefail
base="${KVSTACK_BASE:-}"
if [ "${1:-}" = --base ]; then base="${2:-}"; shift 2 || shift; fi
case "${1:-}" in
  -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
  "") echo "error: PYTHON is required (see --help)" >&2; exit 2;;
esac
python="$1"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# What the pins need, for the message (vllm/, whose pins hold torch's, is beside this script in the
# repo and the image).
[ -n "$base" ] || [ ! -f "$root/vllm/default" ] || base=$(cat "$root/vllm/default")
need=""
if [ -n "$base" ] && [ -f "$root/vllm/$base.env" ]; then
  need=$(sed -n 's/^TORCH_WHEEL=//p' "$root/vllm/$base.env")
  [ -z "$need" ] || need=" (base $base: the pinned torch wheel is $need)"
fi
others=$(for p in python3 python; do
  if command -v "$p" >/dev/null 2>&1; then
    printf '%s -> %s (%s); ' "$p" "$(command -v "$p")" "$("$p" -c 'import sys; print("Python %d.%d.%d" % sys.version_info[:3])' 2>&1 || true)"
  fi
done)
if ! command -v "$python" >/dev/null 2>&1; then
  echo "error: $python not found (PATH=$PATH): this target needs $python$need." >&2
  echo "  found instead: ${others:-no python3 or python at all}" >&2
  echo "  Use a base image with $python and its venv module: python:3.11-slim-bookworm, or Debian bookworm" \
       "with python3 and python3-venv (scripts/make_base_image.sh makes one)." >&2
  exit 2
fi
if ! "$python" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  echo "error: $python ($(command -v "$python")) has no venv/ensurepip module: install its venv package" \
       "(Debian: python3-venv or ${python##*/}-venv) in the base image." >&2
  exit 2
fi
echo "[check_python] $python: $(command -v "$python"), $("$python" -c 'import sys; print("Python %d.%d.%d" % sys.version_info[:3])'), venv ok"
