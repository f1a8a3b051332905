#!/usr/bin/env bash
# Build the kvstack image with its labels computed from the pin files and the patch series.
#
#   scripts/docker_build.sh [--target cuda|cpu] [--tag NAME:TAG] [--base IMAGE[@sha256:DIGEST]]
#                           [--source URL] [--print] [-- EXTRA DOCKER BUILD ARGS...]
#
# --target  cuda (default) or cpu (see the Dockerfile's header)
# --tag     image name (default kvstack:<version>-<target>)
# --base    the base image for that target, ideally by digest (sets CUDA_BASE_IMAGE / CPU_BASE_IMAGE)
# --source  the OCI source label (default: git remote "origin" URL, else "unknown")
# --print   print the docker command instead of running it (no Docker engine needed)
# Labels: see scripts/image_labels.py --help. Revision: `git rev-parse HEAD` (+ "-dirty" for a dirty tree).
# Environment: DOCKER (default docker); the build needs BuildKit (default in Docker 23+).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target=cuda tag="" base="" source="" print=0 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --target) target="$2"; shift 2;;
    --tag) tag="$2"; shift 2;;
    --base) base="$2"; shift 2;;
    --source) source="$2"; shift 2;;
    --print) print=1; shift;;
    --) shift; extra=("$@"); break;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2;;
  esac
done
case "$target" in cuda|cpu) ;; *) echo "error: --target must be cuda or cpu" >&2; exit 2;; esac
python="${PYTHON:-python3}"

revision=unknown
if git -C "$root" rev-parse --verify -q HEAD >/dev/null 2>&1; then
  revision=$(git -C "$root" rev-parse HEAD)
  [ -z "$(git -C "$root" status --porcelain --untracked-files=no)" ] || revision="$revision-dirty"
fi
[ -n "$source" ] || source=$(git -C "$root" config --get remote.origin.url 2>/dev/null || true)
[ -n "$source" ] || source=unknown
version=$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' "$root/pyproject.toml" | head -1)
[ -n "$tag" ] || tag="kvstack:$version-$target"

cmd=("${DOCKER:-docker}" build -f "$root/Dockerfile" --target final -t "$tag"
     --build-arg "TARGET=$target" --build-arg "KVSTACK_REVISION=$revision"
     --build-arg "KVSTACK_VERSION=$version" --build-arg "KVSTACK_SOURCE=$source")
if [ -n "$base" ]; then
  if [ "$target" = cuda ]; then cmd+=(--build-arg "CUDA_BASE_IMAGE=$base"); else cmd+=(--build-arg "CPU_BASE_IMAGE=$base"); fi
  cmd+=(--label "org.opencontainers.image.base.name=$base")
fi
while IFS= read -r label; do
  cmd+=(--label "$label")
done < <("$python" "$root/scripts/image_labels.py" --format labels --target "$target" --revision "$revision" --source "$source")
cmd+=("${extra[@]}" "$root")

if [ "$print" = 1 ]; then
  printf '%q ' "${cmd[@]}"; echo
else
  exec "${cmd[@]}"
fi
