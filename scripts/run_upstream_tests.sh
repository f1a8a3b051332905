#!/usr/bin/env bash
# Run the pinned vLLM sdist's own tests (tests/v1/core/test_kv_cache_utils.py,
# tests/v1/kv_connector/unit/ and worker tests of the layout ladder) against the patched CPU
# venv and compare with the ledger ci/upstream/expected-failures.txt. Run with --help for
# options and exit codes.
#
#   scripts/run_upstream_tests.sh                 # the whole suite (about 7 minutes on 2 cores)
#   scripts/run_upstream_tests.sh --quick         # test_kv_cache_utils.py only (about a minute)
#   scripts/run_upstream_tests.sh tests/v1/kv_connector/unit/test_nixl_connector.py -k hash
#
# Environment: KVSTACK_VENV (default .venv): the venv whose python runs the tests.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVSTACK_VENV:-$root/.venv}"
python="$venv/bin/python"
if [ ! -x "$python" ]; then
  case " $* " in
    *" -h "*|*" --help "*) python="${PYTHON:-python3}";;
    *) echo "error: $python not found: build the environment with scripts/build_env.sh" >&2; exit 2;;
  esac
fi
cd "$root"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m kvstack.testbed.upstream_tests --python "$python" "$@"
