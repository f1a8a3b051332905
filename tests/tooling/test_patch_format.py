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


@pytest.fixture(scope="module")
def series_on_pristine_sdist(tmp_path_factory):
    """(base, component) -> {patch name: (forward result, reverse --check result)}: the series applied
    in order to one pristine copy of the base's pinned sdist (unpacked once per base and component);
    each patch is reverse-checked right after it is applied, before the next one."""
    from kvstack.release.fetch import cached_sdist, extract_sdist

    done: dict = {}

    def get(base, component):
        if (base, component) not in done:
            pristine = tmp_path_factory.mktemp(f"pristine-{base}-{component}") / "tree"
            extract_sdist(cached_sdist(load_pin(component, base)), pristine)
            env = {**os.environ, "GIT_DIR": os.devnull}
            results = {}
            for patch in read_series(load_pin(component, base).series_dir):
                fwd = subprocess.run(["git", "apply", "-p1", str(patch)], cwd=pristine, env=env,
                                     capture_output=True, text=True)
                rev = subprocess.run(["git", "apply", "-R", "--check", str(patch)], cwd=pristine, env=env,
                                     capture_output=True, text=True) if fwd.returncode == 0 else None
                results[patch.name] = (fwd, rev)
                if fwd.returncode != 0:
                    break  # later patches are not tried on a tree missing this one
            shutil.rmtree(pristine)
            done[base, component] = results
        return done[base, component]

    return get


@pytest.mark.parametrize("base,component,patch", ALL, ids=IDS)
def test_patch_applies_to_pinned_sdist_without_fuzz_and_reverses(base, component, patch, series_on_pristine_sdist):
    # The series up to this patch, applied in order to the base's pristine sdist without fuzz.
    results = series_on_pristine_sdist(base, component)
    for name, (fwd, _) in results.items():
        assert fwd.returncode == 0, f"{name} does not apply cleanly: {fwd.stderr}"
        if name == patch.name:
            break
    assert patch.name in results, f"{patch.name} was not reached"
    rev = results[patch.name][1]
    assert rev.returncode == 0, f"{patch.name} does not reverse-apply after applying: {rev.stderr}"
