#!/usr/bin/env bash
# The first half of `make env`: a venv with the base's pinned wheels installed (scripts/build_env.sh
# --deps-only: torch, vLLM, LMCache and their requirements), taken from kvstack's cache when it has
# one for the same inputs, built and kept there otherwise. `make env` then runs build_env.sh in
# full (kvstack, the test tools, the patch stack, doctor) on that venv.
#
#   scripts/venv_cache.sh [--base NAME] [--venv DIR] [--python PY]
#
# The pinned wheels' venv (3-6 GB, minutes of pip) depends only on the pin files, the install
# scripts and the interpreter: it is kept in $KVSTACK_CACHE/venvs/<base>-<hash of those> (only the
# one in use per base stays: 3-6 GB each, docs/testing.md "Disk"), and a new venv of the same inputs
# (a fresh clone's) starts as a copy.
# A venv names its own path only in bin/ (the scripts' #! lines, activate) and pyvenv.cfg: those
# are rewritten for the copy's path (scripts/venv_copy.sh).
# A venv that already has its pinned wheels (build_env.sh's .kvstack-deps stamp) is left as it is.
# Environment: KVSTACK_VENV, KVSTACK_CACHE (default ~/.cache/kvstack), PYTHON as build_env.sh;
#   KVSTACK_VENV_CACHE=0 builds without the cache; KVSTACK_BUILD_ENV (default scripts/build_env.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVSTACK_VENV:-}"
python="${PYTHON:-python3}"
base_arg=""
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base_arg="$2"; shift 2;;
    --venv) venv="$2"; shift 2;;
    --python) python="$2"; shift 2;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2;;
  esac
done
step() { printf '[venv_cache] %s\n' "$*" >&2; }
# shellcheck source=scripts/lib_base.sh
. "$root/scripts/lib_base.sh"
resolve_base "$base_arg"
[ -n "$venv" ] || { if [ "$base" = "$(cat "$root/vllm/default")" ]; then venv="$root/.venv"; else venv="$root/.venv-$base"; fi; }
mkdir -p "$(dirname "$venv")"
venv="$(cd "$(dirname "$venv")" && pwd)/$(basename "$venv")"
build_env="${KVSTACK_BUILD_ENV:-$root/scripts/build_env.sh}"
cache="${KVSTACK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstack}"

if [ -f "$venv/.kvstack-deps" ]; then
  exit 0  # build_env.sh checks that its stamp matches the pins (and rebuilds when not)
fi
key=$( { echo "base $base"; "$python" -c 'import sys; print(sys.version.split()[0], sys.executable)'
         cat "$(pin_file vllm)" "$(pin_file lmcache)" "$build_env" "$root/scripts/lib_wheels.sh" \
             "$root/scripts/lib_base.sh"; } | sha256sum | cut -c1-16)
snap="$cache/venvs/$base-$key"

# kept: only the snapshot of the current inputs (an older one is a pin or script change ago: a
# switch back rebuilds it, minutes, where keeping it costs 3-6 GB of every run's disk)
prune_others() {
  local other
  for other in "$cache/venvs/$base"-*; do
    case "$other" in "$snap"|*.partial) continue;; esac  # a .partial: a build in progress
    [ -d "$other" ] || continue
    step "removing the cached venv of other inputs: $other"
    rm -rf "$other"
  done
}

if [ "${KVSTACK_VENV_CACHE:-1}" != 0 ] && [ -f "$snap/venv/.kvstack-deps" ] && [ -f "$snap/origin" ]; then
  step "base $base: the pinned wheels' venv from the cache ($snap)"
  t0=$SECONDS
  bash "$root/scripts/venv_copy.sh" "$snap/venv" "$venv" "$(cat "$snap/origin")"
  step "  copied to $venv in $((SECONDS - t0)) s"
  prune_others
  exit 0
fi

PYTHON="$python" KVSTACK_VENV="$venv" bash "$build_env" --base "$base" --deps-only
[ "${KVSTACK_VENV_CACHE:-1}" != 0 ] || exit 0
step "keeping a copy in the cache: $snap"
rm -rf "$snap.partial" && mkdir -p "$snap.partial"
cp -a "$venv" "$snap.partial/venv"
echo "$venv" > "$snap.partial/origin"
rm -rf "$snap" && mv "$snap.partial" "$snap"
prune_others
