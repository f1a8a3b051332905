#!/usr/bin/env bash
# Make a Debian bookworm base image from Debian's packages (no base-image registry needed) and import it
# into a builder's local storage, for `scripts/docker_build.sh --target cpu --base-image NAME`.
#
#   scripts/make_base_image.sh [--tag NAME] [--builder docker|podman|buildah] [--storage-driver DRIVER]
#                              [--include PKGS] [--suite SUITE] [--tar FILE]
#
# --tag             image name (default localhost/kvstack-base:bookworm)
# --builder         as scripts/docker_build.sh: default $KVSTACK_BUILDER, else docker with a reachable
#                   daemon, else podman, else buildah; one that is not installed is an error (exit 2)
# --storage-driver  podman/buildah storage driver, chosen as scripts/docker_build.sh does
# --include         packages besides the minbase variant (default python3,python3-venv,ca-certificates:
#                   bookworm's python3 is Python 3.11, what the cpu target's pinned wheels need);
#                   --include ca-certificates makes a base without Python (the tests' bad base)
# --suite           Debian suite (default bookworm)
# --tar             where mmdebstrap writes the root file system tarball, kept (default: a temporary
#                   file, removed)
# Runs: mmdebstrap --variant=minbase --include=PKGS SUITE FILE.tar (about 30-60 s from Debian's mirror;
# needs root, or mmdebstrap's unshare mode), then imports FILE.tar: buildah from scratch + buildah add +
# buildah commit, or podman/docker import. Prints the image name.
# Exit codes: 0 ok, 2 usage error or missing tool, else the failing tool's.
set -euo pipefail
tag=localhost/kvstack-base:bookworm builder="${KVSTACK_BUILDER:-}" storage_driver="${KVSTACK_STORAGE_DRIVER:-${STORAGE_DRIVER:-}}"
include=python3,python3-venv,ca-certificates suite=bookworm tar=""
die() { echo "error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --tag|--builder|--storage-driver|--include|--suite|--tar) [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value";;
  esac
  case "$1" in
    --tag) tag="$2"; shift 2;;
    --builder) builder="$2"; shift 2;;
    --storage-driver) storage_driver="$2"; shift 2;;
    --include) include="$2"; shift 2;;
    --suite) suite="$2"; shift 2;;
    --tar) tar="$2"; shift 2;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
    *) die "unknown argument $1 (see --help)";;
  esac
done
# shellcheck source=scripts/lib_builder.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib_builder.sh"
choose_builder "$builder"
command -v mmdebstrap >/dev/null 2>&1 || die "mmdebstrap is not installed (Debian/Ubuntu: apt-get install mmdebstrap)"
default_storage_driver
sd=(); [ -z "$storage_driver" ] || [ "$builder" = docker ] || sd=(--storage-driver "$storage_driver")

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
[ -n "$tar" ] || tar="$tmp/base.tar"
echo "[make_base_image] mmdebstrap --variant=minbase --include=$include $suite $tar" >&2
mmdebstrap --quiet --variant=minbase --include="$include" "$suite" "$tar"
echo "[make_base_image] importing into $builder (${storage_driver:-default} storage) as $tag" >&2
case "$builder" in
  buildah)
    ctr=$(buildah "${sd[@]}" from scratch)
    # Remove the working container even when a step fails.
    trap 'buildah "${sd[@]}" rm "$ctr" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
    buildah "${sd[@]}" add "$ctr" "$tar" / >/dev/null
    buildah "${sd[@]}" config --cmd /bin/bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      --label "kvstack.base.made-by=scripts/make_base_image.sh" --label "kvstack.base.include=$include" \
      --label "kvstack.base.suite=$suite" "$ctr"
    buildah "${sd[@]}" commit --quiet "$ctr" "$tag" >/dev/null;;
  podman|docker)
    "$builder" "${sd[@]}" import --change 'CMD ["/bin/bash"]' \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' "$tar" "$tag" >/dev/null;;
esac
echo "$tag"
