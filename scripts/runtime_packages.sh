#!/usr/bin/env bash
# Install the cpu image's run-time packages on its base image with apt-get (Debian/Ubuntu bases):
#
#   scripts/runtime_packages.sh PYTHON PACKAGE...
#
# Installs the PACKAGEs, plus PYTHON's C headers (libpythonX.Y-dev) when PYTHON has none: vLLM's default
# CPU compile mode (torch inductor) compiles C++ against Python.h at run time. python:3.11-slim has them
# (/usr/local/include/python3.11); Debian's python3.11 needs libpython3.11-dev. Removes apt's lists after.
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
  "") echo "error: PYTHON is required (see --help)" >&2; exit 2;;
esac
python="$1"; shift
pkgs=("$@")
include=$("$python" -c 'import sysconfig; print(sysconfig.get_path("include"))')
if [ ! -f "$include/Python.h" ]; then
  version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  pkgs+=("libpython$version-dev")
  echo "[runtime_packages] $python has no $include/Python.h (torch inductor needs it): adding libpython$version-dev"
fi
apt-get update
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${pkgs[@]}"
rm -rf /var/lib/apt/lists/*
