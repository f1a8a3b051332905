# The image builder and its storage driver, shared by scripts/docker_build.sh and
# scripts/make_base_image.sh (sourced, not run). The caller defines die().

# choose_builder BUILDER [CHECK_INSTALLED]: sets $builder. An explicit BUILDER must be docker, podman
# or buildah and (unless CHECK_INSTALLED is 0) on PATH; an empty one is detected: docker with a
# reachable daemon, else podman, else buildah. Anything else exits 2 through die().
choose_builder() {
  builder="$1"
  local check="${2:-1}"
  if [ -n "$builder" ]; then
    case "$builder" in
      docker|podman|buildah) ;;
      *) die "--builder must be docker, podman or buildah, not '$builder'";;
    esac
    if [ "$check" = 1 ] && ! command -v "$builder" >/dev/null 2>&1; then
      die "--builder $builder: '$builder' is not installed (not on PATH)"
    fi
  elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then builder=docker
  elif command -v podman >/dev/null 2>&1; then builder=podman
  elif command -v buildah >/dev/null 2>&1; then builder=buildah
  else die "no image builder found: install Docker (with a running daemon), Podman or Buildah, or pass --builder"
  fi
}

# default_storage_driver: for podman/buildah with no $storage_driver set, what the local
# containers/storage already uses (vfs or overlay), else vfs for buildah (works without overlayfs
# or user namespaces). Docker keeps its own.
default_storage_driver() {
  [ "$builder" != docker ] && [ -z "$storage_driver" ] || return 0
  local graphroot
  if [ "$(id -u)" = 0 ]; then graphroot=/var/lib/containers/storage
  else graphroot="${XDG_DATA_HOME:-$HOME/.local/share}/containers/storage"; fi
  if [ -d "$graphroot/vfs-images" ]; then storage_driver=vfs
  elif [ -d "$graphroot/overlay-images" ]; then storage_driver=overlay
  elif [ "$builder" = buildah ]; then storage_driver=vfs
  fi
}
