"""The rules every patch of every base (patches/<base>/<component>/) obeys (DEP-3 style headers,
clean application to that base's pinned sdist)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from kvstack.release.patchstack import patch_headers, read_series, touched_paths
from kvstack.release.pins import COMPONENTS, base_names, load_pin

BASE_COMPONENTS = [(b, c) for b in base_names() for c in COMPONENTS]
ALL = [(b, c, p) for b, c in BASE_COMPONENTS for p in read_series(load_pin(c, b).series_dir)]
IDS = [f"{b}/{c}/{p.name}" for b, c, p in ALL]
STATUS = re.compile(r"^Upstream-Status: (Backport|Submitted|Pending|Inappropriate|Accepted)\b.*", re.M)


@pytest.mark.parametrize("base,component", BASE_COMPONENTS)
def test_series_and_folder_agree(base, component):
    d = load_pin(component, base).series_dir
    listed = [p.name for p in read_series(d)]
    assert len(listed) == len(set(listed)), "a patch is listed twice"
    for name in listed:
        assert (d / name).is_file(), f"series lists {name}, which does not exist"
    for path in d.glob("*.patch"):
        assert path.name in listed, f"{path.name} is not in the series"


@pytest.mark.parametrize("base,component,patch", ALL, ids=IDS)
def test_patch_is_format_patch_with_a_why_and_a_status(base, component, patch):
    text = patch.read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 "), "not git format-patch (--zero-commit)"
    msg = patch_headers(patch)
    for field in ("From", "Date", "Subject"):
        assert msg[field], f"no {field}: header"
    body = text.split("\n\n", 1)[1].split("\n---\n", 1)[0]
    assert STATUS.search(body), "no valid 'Upstream-Status:' line"
    assert re.search(r"^Drop-When: \S", body, re.M), "no 'Drop-When:' line saying when to drop it"
    prose = [ln for ln in body.splitlines() if ln.strip() and not re.match(r"^[A-Z][\w-]+: ", ln)]
    assert len(" ".join(prose)) > 80, "the body must say why the patch exists"
    assert touched_paths(patch), "touches no file"


@pytest.mark.parametrize("base,component,patch", ALL, ids=IDS)
def test_patch_applies_to_pinned_sdist_without_fuzz_and_reverses(base, component, patch, tmp_path):
    # Apply the series up to this patch on a scratch copy of the files it touches, from a pristine sdist.
    from kvstack.release.fetch import cached_sdist, extract_sdist

    pristine = tmp_path / "pristine"
    extract_sdist(cached_sdist(load_pin(component, base)), pristine)
    env = {**os.environ, "GIT_DIR": os.devnull}
    for earlier in read_series(load_pin(component, base).series_dir):
        fwd = subprocess.run(["git", "apply", "-p1", str(earlier)], cwd=pristine, env=env, capture_output=True, text=True)
        assert fwd.returncode == 0, f"{earlier.name} does not apply cleanly: {fwd.stderr}"
        if earlier == patch:
            break
    rev = subprocess.run(["git", "apply", "-R", "--check", str(patch)], cwd=pristine, env=env, capture_output=True, text=True)
    assert rev.returncode == 0, f"{patch.name} does not reverse-apply after applying: {rev.stderr}"
    shutil.rmtree(pristine)
