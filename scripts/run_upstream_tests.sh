#!/usr/bin/env bash
# Run a base's pinned vLLM sdist's own tests (tests/v1/core/test_kv_cache_utils.py,
# tests/v1/kv_connector/unit/ and worker tests of the layout ladder) against the base's patched CPU
# venv and compare with the base's ledger ci/upstream/<base>/expected-failures.txt. Run with --help
# for options and exit codes.
#
#   scripts/run_upstream_tests.sh                 # the whole suite, default base (about 7 minutes on 2 cores)
#   scripts/run_upstream_tests.sh --base 0.32     # the whole suite on base 0.32 (its venv .venv-0.32)
#   scripts/run_upstream_tests.sh --quick         # test_kv_cache_utils.py only (about a minute)
#   scripts/run_upstream_tests.sh tests/v1/kv_connector/unit/test_nixl_connector.py -k hash
#
# Environment: KVSTACK_BASE (default vllm/default; --base wins), KVSTACK_VENV (default .venv for the
# default base, .venv-<base> for another): the venv whose python runs the tests (--python wins).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
default_base="$(cat "$root/vllm/default")"
base="${KVSTACK_BASE:-$default_base}" python=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --base) base="${args[i+1]:-}";;
    --base=*) base="${args[i]#--base=}";;
    --python) python="${args[i+1]:-}";;
    --python=*) python="${args[i]#--python=}";;
  esac
done
if [ -z "$python" ]; then
  if [ -n "${KVSTACK_VENV:-}" ]; then venv="$KVSTACK_VENV"
  elif [ "$base" = "$default_base" ]; then venv="$root/.venv"
  else venv="$root/.venv-$base"; fi
  python="$venv/bin/python"
  set -- --python "$python" "$@"
fi
if [ ! -x "$python" ]; then
  case " $* " in
    *" -h "*|*" --help "*) python="${PYTHON:-python3}";;
    *) echo "error: $python not found: build the environment with scripts/build_env.sh --base $base" >&2; exit 2;;
  esac
fi
cd "$root"
KVSTACK_BASE="$base" PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m kvstack.testbed.upstream_tests "$@"
