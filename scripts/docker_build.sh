#!/usr/bin/env bash
# Build the kvstack image of one base with Docker (BuildKit), Podman or Buildah, with its labels computed
# from that base's pin files and patch series.
#
#   scripts/docker_build.sh [--base NAME] [--target cuda|cpu] [--tag NAME:TAG]
#                           [--base-image IMAGE[@sha256:DIGEST]]
#                           [--builder docker|podman|buildah] [--storage-driver DRIVER]
#                           [--ca-cert FILE] [--wheelhouse DIR | --no-wheelhouse]
#                           [--source URL] [--deps-only] [--print] [-- EXTRA BUILD ARGS...]
#
# --base            the kvstack base (vllm/NAME.env + lmcache/NAME.env: its pins, patches/NAME/: its series;
#                   build arg KVSTACK_BASE); default $KVSTACK_BASE, else vllm/default. An unknown base is an error (exit 2).
# --target          cuda (default) or cpu (see the Dockerfile's header)
# --tag             image name (default kvstack:<version>-<base>-<target>, e.g. kvstack:0.1.0-0.25-cpu)
# --base-image      the container's base image for that target (sets CUDA_BASE_IMAGE / CPU_BASE_IMAGE): a
#                   registry image, ideally by digest, or one that exists only in the builder's local
#                   storage (e.g. localhost/kvstack-base:bookworm from scripts/make_base_image.sh). The
#                   cuda target's default is localhost/kvstack-base:bookworm, made first when missing.
# --builder         default $KVSTACK_BUILDER, else detected: docker when its daemon answers, else
#                   podman, else buildah. A builder that is not installed is an error (exit 2).
# --storage-driver  podman/buildah storage driver; default $KVSTACK_STORAGE_DRIVER or $STORAGE_DRIVER
#                   (buildah's and podman's own variable), else the driver the
#                   local storage already uses (vfs-images/ or overlay-images/ under it), else vfs for
#                   buildah (works in any container or VM; slow: every layer is a full copy) and the
#                   builder's own default for podman. Not used with docker.
# --ca-cert         a CA bundle for a TLS-inspecting proxy: passed as the build secret pip_cert
#                   (--secret id=pip_cert,src=FILE); pip inside the build trusts it, no layer keeps it
# --wheelhouse      a folder of pinned wheels bind-mounted read-only into the install steps (named build
#                   context `wheelhouse`); default: the kvstack wheel cache ($KVSTACK_CACHE/wheels,
#                   ~/.cache/kvstack/wheels) when it exists. --no-wheelhouse: download everything.
# --source          the OCI source label (default: git remote "origin" URL, else "unknown")
# --deps-only       build only the `deps` stage (the base's pinned wheels): podman/buildah tag it
#                   localhost/kvstack-deps:... as below (nothing when it is there already); docker
#                   builds --target deps into its layer cache. A later full build reuses it.
# --print           print the build command instead of running it (no builder needed)
# Buildah runs as `buildah bud --isolation chroot` ($KVSTACK_ISOLATION or BUILDAH_ISOLATION
# overrides chroot). Podman/Buildah first build the Dockerfile's `deps` stage (the pinned wheels, 6 GB)
# as its own image, localhost/kvstack-deps:<base>-<target>-<hash of the base's pin files, the install
# scripts, the Dockerfile up to that stage and the base image>, only when that tag is missing, and build
# the image on it (--build-context deps=docker-image://...): a change to kvstack's sources reinstalls
# only kvstack.
# Labels: see scripts/image_labels.py --help. Revision: `git rev-parse HEAD` (+ "-dirty" for a dirty tree).
# Exit codes: 0 built (or printed), 2 usage error (bad option, unknown base, builder not installed,
# missing file; nothing is built), else the builder's own exit code.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target=cuda tag="" base_arg="" base_image="" source="" print=0 deps_only=0 extra=() builder="${KVSTACK_BUILDER:-}"
storage_driver="${KVSTACK_STORAGE_DRIVER:-${STORAGE_DRIVER:-}}" ca_cert="" wheelhouse="" use_wheelhouse=1
die() { echo "error: $*" >&2; exit 2; }
need_value() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (see --help)"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --target|--tag|--base|--base-image|--source|--builder|--storage-driver|--ca-cert|--wheelhouse) need_value "$@";;
  esac
  case "$1" in
    --target) target="$2"; shift 2;;
    --tag) tag="$2"; shift 2;;
    --base) base_arg="$2"; shift 2;;
    --base-image) base_image="$2"; shift 2;;
    --source) source="$2"; shift 2;;
    --builder) builder="$2"; shift 2;;
    --storage-driver) storage_driver="$2"; shift 2;;
    --ca-cert) ca_cert="$2"; shift 2;;
    --wheelhouse) wheelhouse="$2"; shift 2;;
    --no-wheelhouse) use_wheelhouse=0; shift;;
    --deps-only) deps_only=1; shift;;
    --print) print=1; shift;;
    --) shift; extra=("$@"); break;;
    -h|--help) sed -n '2,43p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
    *) die "unknown argument $1 (see --help)";;
  esac
done
case "$target" in cuda|cpu) ;; *) die "--target must be cuda or cpu, not '$target'";; esac
python="${PYTHON:-python3}"

# The builder: chosen, or detected (--print alone: docker, installed or not).
# shellcheck source=scripts/lib_builder.sh
. "$root/scripts/lib_builder.sh"
if [ -z "$builder" ] && [ "$print" = 1 ]; then builder=docker; fi
choose_builder "$builder" "$((1 - print))"
# The kvstack base: its pin files feed the deps image's key, the labels and the default tag.
# shellcheck source=scripts/lib_base.sh
. "$root/scripts/lib_base.sh"
case "$base_arg" in
  */*|*:*|*@*) die "--base names a kvstack base (vllm/NAME.env, e.g. $(cat "$root/vllm/default")), not '$base_arg': the container's base image is --base-image";;
esac
resolve_base "$base_arg"
[ -z "$ca_cert" ] || [ -f "$ca_cert" ] || die "--ca-cert $ca_cert: no such file"
if [ "$use_wheelhouse" = 1 ] && [ -z "$wheelhouse" ]; then
  wheelhouse="${KVSTACK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstack}/wheels"
  [ -d "$wheelhouse" ] || wheelhouse=""
elif [ "$use_wheelhouse" = 1 ]; then
  [ -d "$wheelhouse" ] || die "--wheelhouse $wheelhouse: no such folder"
else
  wheelhouse=""
fi

# containers/storage driver of podman/buildah: explicit, else what the local storage already uses.
default_storage_driver

revision=unknown
if git -C "$root" rev-parse --verify -q HEAD >/dev/null 2>&1; then
  revision=$(git -C "$root" rev-parse HEAD)
  [ -z "$(git -C "$root" status --porcelain --untracked-files=no)" ] || revision="$revision-dirty"
fi
[ -n "$source" ] || source=$(git -C "$root" config --get remote.origin.url 2>/dev/null || true)
[ -n "$source" ] || source=unknown
version=$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' "$root/pyproject.toml" | head -1)
[ -n "$tag" ] || tag="kvstack:$version-$base-$target"

# The cuda target's default base is made here (Debian bookworm, scripts/make_base_image.sh): named
# explicitly so that it is never looked up in a registry, and made first when the storage lacks it.
made_base=0
if [ "$target" = cuda ] && [ -z "$base_image" ]; then
  base_image=localhost/kvstack-base:bookworm
  made_base=1
fi

# Arguments both builds share (the deps image's and the final one's).
common=(-f "$root/Dockerfile" --build-arg "TARGET=$target" --build-arg "KVSTACK_BASE=$base")
if [ -n "$base_image" ]; then
  if [ "$target" = cuda ]; then common+=(--build-arg "CUDA_BASE_IMAGE=$base_image"); else common+=(--build-arg "CPU_BASE_IMAGE=$base_image"); fi
  # A base only in local storage: never try a registry for it.
  [ "$builder" = docker ] || common+=(--pull=never)
fi
[ -z "$ca_cert" ] || common+=(--secret "id=pip_cert,src=$ca_cert")
[ -z "$wheelhouse" ] || common+=(--build-context "wheelhouse=$wheelhouse")

case "$builder" in
  docker) tool=(docker); build=(build);;
  podman) tool=(podman); build=(build);;
  buildah)
    tool=(buildah); build=(bud --isolation "${KVSTACK_ISOLATION:-${BUILDAH_ISOLATION:-chroot}}");;
esac
[ "$builder" = docker ] || [ -z "$storage_driver" ] || tool+=(--storage-driver "$storage_driver")

# Podman/Buildah: the heavy `deps` stage is built once as its own image, tagged by a hash of everything
# it is made from (the Dockerfile up to it, the base's pin files, the install scripts, the target and the
# base image),
# and reused through `--build-context deps=docker-image://TAG`. Their `--layers` cache would do the same
# but commits and copies a working container per instruction: with vfs storage, a full copy of the
# 7 GB image for each label. Docker (BuildKit) caches the stage itself.
if [ "$made_base" = 1 ] && [ "$print" = 0 ]; then
  have_base=0
  if [ "$builder" = docker ]; then docker image inspect "$base_image" >/dev/null 2>&1 && have_base=1
  else "${tool[@]}" inspect --type image "$base_image" >/dev/null 2>&1 && have_base=1; fi
  if [ "$have_base" = 0 ]; then
    echo "[docker_build] making the cuda target's base image $base_image (scripts/make_base_image.sh)" >&2
    sdo=(); [ -z "$storage_driver" ] || [ "$builder" = docker ] || sdo=(--storage-driver "$storage_driver")
    bash "$root/scripts/make_base_image.sh" --builder "$builder" "${sdo[@]}" --tag "$base_image" >&2
  fi
fi
deps_cmd=()
if [ "$builder" != docker ]; then
  base_id=""
  if [ -n "$base_image" ]; then
    base_id=$("${tool[@]}" inspect --type image --format '{{.FromImageID}}' "$base_image" 2>/dev/null ||
              "${tool[@]}" image inspect --format '{{.Id}}' "$base_image" 2>/dev/null || true)
  fi
  # Everything the stages up to `deps` read: the same list as the Dockerfile's COPY and bind mounts.
  deps_key=$( { sed '/^FROM deps AS /,$d' "$root/Dockerfile"
                cat "$(pin_file vllm)" "$(pin_file lmcache)" "$root/scripts/install_image.sh" \
                    "$root/scripts/build_env.sh" "$root/scripts/lib_wheels.sh" "$root/scripts/lib_base.sh" \
                    "$root/scripts/check_python.sh" "$root/scripts/runtime_packages.sh"
                echo "target=$target kvstack_base=$base base_image=$base_image base_id=$base_id"; } | sha256sum | cut -c1-16)
  deps_tag="localhost/kvstack-deps:$base-$target-$deps_key"
  deps_cmd=("${tool[@]}" "${build[@]}" --target deps -t "$deps_tag" "${common[@]}" "$root")
  common+=(--build-context "deps=docker-image://$deps_tag")
fi

cmd=("${tool[@]}" "${build[@]}" --target final -t "$tag" "${common[@]}"
     --build-arg "KVSTACK_REVISION=$revision" --build-arg "KVSTACK_VERSION=$version"
     --build-arg "KVSTACK_SOURCE=$source")
[ -z "$base_image" ] || cmd+=(--label "org.opencontainers.image.base.name=$base_image")
while IFS= read -r label; do
  cmd+=(--label "$label")
done < <("$python" "$root/scripts/image_labels.py" --format labels --base "$base" --target "$target" --revision "$revision" --source "$source")
cmd+=("${extra[@]}" "$root")

if [ "$deps_only" = 1 ] && [ ${#deps_cmd[@]} = 0 ]; then
  # docker: the deps stage alone, into BuildKit's cache (no labels, no tag).
  cmd=("${tool[@]}" "${build[@]}" --target deps "${common[@]}" "${extra[@]}" "$root")
fi
if [ "$print" = 1 ]; then
  # podman/buildah: the deps image's build (run only when that tag is missing), then the image's.
  [ ${#deps_cmd[@]} = 0 ] || { printf '%q ' "${deps_cmd[@]}"; echo; }
  [ "$deps_only" = 1 ] && [ ${#deps_cmd[@]} -gt 0 ] || { printf '%q ' "${cmd[@]}"; echo; }
  exit 0
fi
if [ ${#deps_cmd[@]} -gt 0 ]; then
  if "${tool[@]}" inspect --type image "$deps_tag" >/dev/null 2>&1; then
    echo "[docker_build] deps image $deps_tag is up to date (base $base's pin files and the install scripts unchanged): reused" >&2
  else
    echo "[docker_build] building the deps image $deps_tag (base $base's pinned wheels; rebuilt only when its pin files, the install scripts or the base image change)" >&2
    t0=$SECONDS
    "${deps_cmd[@]}"
    echo "[docker_build] stage deps: built in $((SECONDS - t0)) s ($deps_tag)" >&2
  fi
  [ "$deps_only" = 0 ] || { echo "[docker_build] --deps-only: $deps_tag" >&2; exit 0; }
fi
t0=$SECONDS
"${cmd[@]}"
echo "[docker_build] stage final: built in $((SECONDS - t0)) s ($tag)" >&2
