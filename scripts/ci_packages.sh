#!/usr/bin/env bash
# The Debian packages the tests use, installed once before `make test` (what .ci/run runs first):
#
#   scripts/ci_packages.sh [--check]
#
#   buildah, mmdebstrap  the image tests (tests/env/test_image_build.py, test_image_cuda.py)
#   redis-server         the shared tier over redis (kvstack/testbed/backend_servers.py)
#
# Only what is missing is installed (`apt-get update` only when an install needs it), with apt's lock
# waited for: on a fresh machine the tests would otherwise install them themselves, two test workers at
# once, and the second apt-get fails on dpkg's lock (exit status 100). Not root, or no apt-get: says what
# is missing and exits 0 (the tests then skip or fail as they do today). --check: list what is missing.
# Progress goes to stderr.
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
  --check|"") ;;
  *) echo "error: unknown argument $1 (see --help)" >&2; exit 2;;
esac
missing=()
for pkg in buildah mmdebstrap redis-server; do  # each package's command has its name
  command -v "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
say() { echo "[ci_packages] $*" >&2; }
if [ ${#missing[@]} -eq 0 ]; then say "buildah, mmdebstrap, redis-server: installed"; exit 0; fi
if [ "${1:-}" = --check ]; then say "missing: ${missing[*]}"; exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  say "missing: ${missing[*]} (not root or no apt-get: not installed here; the tests that need them skip, or fail under CI)"
  exit 0
fi
apt=(apt-get -o DPkg::Lock::Timeout=600 -y --no-install-recommends)
export DEBIAN_FRONTEND=noninteractive
start=$(date +%s)
say "installing ${missing[*]}"
if ! "${apt[@]}" install "${missing[@]}" >/tmp/ci_packages.log 2>&1; then
  say "apt-get update (the package lists are missing or stale)"
  "${apt[@]}" update >>/tmp/ci_packages.log 2>&1
  "${apt[@]}" install "${missing[@]}" >>/tmp/ci_packages.log 2>&1 \
    || { tail -20 /tmp/ci_packages.log >&2; say "error: apt-get install ${missing[*]} failed"; exit 1; }
fi
say "installed ${missing[*]} in $(( $(date +%s) - start )) s"
