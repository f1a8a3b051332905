#!/usr/bin/env bash
# Copy a venv to another path, where it works as if built there.
#
#   scripts/venv_copy.sh SRC DEST [ORIGIN]
#
# A venv names its own path only in bin/ (the scripts' #! lines, activate) and pyvenv.cfg: in the
# copy, ORIGIN (default: SRC, the path SRC's venv was built at) is rewritten to DEST there, and bin/'s
# bytecode (compiled at the old path) is dropped. The copy is made beside DEST (DEST.partial) and
# moved into place whole; an existing DEST is replaced. Used by scripts/venv_cache.sh (a fresh
# clone's venv from kvstack's cache) and kvstack/testbed/venv_snapshot.py (the tests' venvs).
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
[ $# -ge 2 ] && [ $# -le 3 ] || { echo "usage: $0 SRC DEST [ORIGIN] (see --help)" >&2; exit 2; }
src="$1" dest="$2" origin="${3:-$1}"
[ -f "$src/pyvenv.cfg" ] || { echo "error: $src is not a venv (no pyvenv.cfg)" >&2; exit 2; }
rm -rf "$dest" "$dest.partial"
mkdir -p "$(dirname "$dest")"
cp -a "$src" "$dest.partial"
rm -rf "$dest.partial/bin/__pycache__"
pattern=$(printf '%s' "$origin" | sed 's/[][\.*^$|]/\\&/g')
{ grep -rlIZ -F -- "$origin" "$dest.partial/bin" "$dest.partial/pyvenv.cfg" || true; } |
  xargs -0 -r sed -i "s|$pattern|$dest|g"
mv "$dest.partial" "$dest"
