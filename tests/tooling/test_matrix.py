"""The regression matrix (ci/run_matrix.py, the kvstack/matrix/ package) and `kvstack upstream-status`.

No venv and no network: fake releases are small sdists written into a temporary
KVSTACK_CACHE, with their sha256 in a temporary matrix.toml. The real pinned sdists are
used only where they are already cached (~/.cache/kvstack/sdists), else those tests skip.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kvtest import REPO, make_patch

from kvstack import matrix as M
from kvstack.matrix import upstream_status as U
from kvstack.release.patchstack import read_series
from kvstack.release.pins import COMPONENTS, base_names, cache_dir, load_pin

# --------------------------------------------------------------------------- fake releases

BASE = "".join(f"x{i} = {i}\n" for i in range(1, 41))
SHAPE_OLD = "def shape(b, h, d):\n    return (2, b, h, d)\n"
SHAPE_NEW = "def shape(b, h, d):\n    return (b, h, 2 * d)\n"


def attn(version: str) -> str:
    """vllm/attn.py as each fake vLLM release has it."""
    if version == "0.1.0":  # the pin
        return BASE + SHAPE_OLD
    if version == "0.2.0":  # 5 lines more on top (offsets), our packed change merged verbatim
        return "".join(f"new{i} = {i}\n" for i in range(5)) + BASE + SHAPE_NEW
    if version == "0.3.0":  # x30 rewritten (conflict), packed upstream in another form
        return BASE.replace("x30 = 30\n", "x30 = 300\n") + SHAPE_NEW.replace("2 * d)", "2 * d)  # packed upstream")
    raise KeyError(version)


def make_sdist(dest: Path, project: str, version: str, files: dict[str, str]) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{project}-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in {**files, "PKG-INFO": f"Name: {project}\nVersion: {version}\n"}.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{project}-{version}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


FAKE_BASE = "0.1"


@pytest.fixture
def fake_repo(tmp_path, monkeypatch):
    """A kvstack checkout with one fake base 0.1 (vllm 0.1.0, lmcache 1.0.0), a matrix.toml, cached fake sdists."""
    root = tmp_path / "repo"
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVSTACK_CACHE", str(cache))
    monkeypatch.delenv("KVSTACK_BASE", raising=False)
    sdists = cache / "sdists"
    vers = {"vllm": ["0.1.0", "0.2.0", "0.3.0"], "lmcache": ["1.0.0", "1.1.0"]}
    digests = {}
    for v in vers["vllm"]:
        p = make_sdist(sdists, "vllm", v, {"vllm/__init__.py": "", "vllm/attn.py": attn(v)})
        digests[p.name] = M.sha256_of(p)
    for v in vers["lmcache"]:
        body = "a = 1\nb = 2\n" if v == "1.0.0" else "a = 1\nb = 2\nc = 3\n"
        p = make_sdist(sdists, "lmcache", v, {"lmcache/__init__.py": "", "lmcache/core.py": body})
        digests[p.name] = M.sha256_of(p)
    for comp in COMPONENTS:
        (root / comp).mkdir(parents=True)
    (root / "vllm" / "default").write_text(FAKE_BASE + "\n")
    for comp in COMPONENTS:
        pin = vers[comp][0]
        (root / comp / f"{FAKE_BASE}.env").write_text(
            f"PROJECT={comp}\nVERSION={pin}\nSDIST={comp}-{pin}.tar.gz\n"
            f"SDIST_SHA256={digests[f'{comp}-{pin}.tar.gz']}\n")
        (root / "patches" / FAKE_BASE / comp).mkdir(parents=True)
        (root / "patches" / FAKE_BASE / comp / "series").write_text("# fixture series\n")
    (root / "ci" / "probes").mkdir(parents=True)
    toml = ['suites = ["apply", "unit", "e2e-cpu", "gpu"]', "",
            "[vllm]", 'releases = ["0.1.0", "0.3.0", "0.2.0"]', "",
            "[lmcache]", 'releases = ["1.0.0", "1.1.0"]', "", "[sha256]"]
    toml += [f'"{k}" = "{v}"' for k, v in digests.items() if not k.endswith(("0.1.0.tar.gz", "1.0.0.tar.gz"))]
    (root / "ci" / "matrix.toml").write_text("\n".join(toml) + "\n")
    return root


def add_patch(root: Path, comp: str, name: str, text: str, base: str = FAKE_BASE) -> Path:
    d = root / "patches" / base / comp
    (d / name).write_text(text)
    with open(d / "series", "a") as fh:
        fh.write(name + "\n")
    return d / name


def pin_tree(root: Path, comp: str) -> Path:
    config = M.load_config(root / "ci" / "matrix.toml", root)
    return M.release_tree(config, comp, config.pins[comp], offline=True)[0]


def stack(root: Path, tmp_path: Path, probe: bool = True) -> None:
    """Three vLLM patches and one LMCache patch, each made against the pinned fake tree."""
    src = pin_tree(root, "vllm")
    add_patch(root, "vllm", "0001-pack.patch",
              make_patch(tmp_path, "vllm/attn.py", SHAPE_OLD, SHAPE_NEW, "pack K/V", src)
              .replace("Inappropriate [test fixture]", "Backport [vllm-project/vllm#44455, in 0.2.0]"))
    add_patch(root, "vllm", "0002-x30.patch",
              make_patch(tmp_path, "vllm/attn.py", "x29 = 29\nx30 = 30\n", "x29 = 29\nx30 = 31\n", "x30", src)
              .replace("Inappropriate [test fixture]", "Pending"))
    add_patch(root, "vllm", "0003-init.patch",
              make_patch(tmp_path, "vllm/__init__.py", "", "# kvstack\n", "init", src))
    lsrc = pin_tree(root, "lmcache")
    add_patch(root, "lmcache", "0001-core.patch", make_patch(tmp_path, "lmcache/core.py", "a = 1\n", "a = 10\n", "core", lsrc))
    if probe:
        (root / "ci" / "probes" / "vllm").mkdir(parents=True, exist_ok=True)
        (root / "ci" / "probes" / "vllm" / "0001-pack.py").write_text(
            "from pathlib import Path\n\n\ndef probe(tree: Path) -> bool:\n"
            "    return '2 * d' in (tree / 'vllm' / 'attn.py').read_text()\n\n\nTESTS = ['tests.test_pack*']\n")


def run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "ci" / "run_matrix.py"), "--root", str(root), "--no-png",
                           "--offline", "--color", "never", *args], capture_output=True, text=True,
                          env={**os.environ, "KVSTACK_CACHE": os.environ["KVSTACK_CACHE"]})


def series_of(root: Path) -> dict:
    return {c: read_series(root / "patches" / FAKE_BASE / c) for c in COMPONENTS}


def matrix(root: Path, suites=("apply",), results=()) -> dict:
    config = M.load_config(root / "ci" / "matrix.toml", root)
    specs = [M.parse_result_spec(r, config.pins) for r in results]
    return M.run_matrix(config, list(suites), series_of(root), root / "ci" / "probes", specs, offline=True)


# --------------------------------------------------------------------------- configuration


def test_real_config_has_the_issue_axes():
    config = M.load_config()
    assert config.releases["vllm"] == ["0.25.1", "0.26.0", "0.27.1", "0.29.0", "0.32.0", "0.33.0"]
    assert config.releases["lmcache"] == ["0.5.3", "0.5.6"]
    assert config.suites == ["apply", "unit", "e2e-cpu", "gpu"]
    assert config.pins == {c: load_pin(c).version for c in COMPONENTS}
    every_pin = {c: {load_pin(c, b).version for b in base_names()} for c in COMPONENTS}
    for comp, versions in config.releases.items():
        for v in versions:
            if v not in every_pin[comp]:  # a base's pin has its digest in <comp>/<base>.env
                assert re.fullmatch(r"[0-9a-f]{64}", config.sha256[f"{comp}-{v}.tar.gz"])


def test_adding_a_release_is_one_line(tmp_path, monkeypatch):
    text = (REPO / "ci" / "matrix.toml").read_text()
    new = text.replace('  "0.33.0",\n', '  "0.33.0",\n  "0.34.0",\n', 1)
    assert len(new.splitlines()) == len(text.splitlines()) + 1
    (tmp_path / "m.toml").write_text(new)
    config = M.load_config(tmp_path / "m.toml")
    assert config.releases["vllm"][-1] == "0.34.0"
    # unlisted pins are still checked, and order in the file does not matter
    (tmp_path / "m2.toml").write_text('[vllm]\nreleases = ["0.33.0", "0.26.0"]\n')
    # (every base's pin: 0.25.1 of base 0.25 and 0.32.0 of base 0.32)
    assert M.load_config(tmp_path / "m2.toml").releases["vllm"] == ["0.25.1", "0.26.0", "0.32.0", "0.33.0"]


# --------------------------------------------------------------------------- the apply suite


def test_apply_states_per_release_and_patch(fake_repo, tmp_path):
    stack(fake_repo, tmp_path)
    doc = matrix(fake_repo)
    v = doc["apply"][FAKE_BASE]["vllm"]
    assert v["0001-pack.patch"]["0.1.0"]["state"] == M.S_APPLIES
    assert v["0001-pack.patch"]["0.2.0"] == {"state": M.S_UPSTREAM, "detail": "", "how": "reverse-applies", "note": ""}
    assert v["0001-pack.patch"]["0.3.0"]["state"] == M.S_UPSTREAM
    assert v["0001-pack.patch"]["0.3.0"]["how"] == "probe"
    assert "conflicts textually" in v["0001-pack.patch"]["0.3.0"]["note"]
    assert v["0002-x30.patch"]["0.1.0"]["state"] == M.S_APPLIES
    assert v["0002-x30.patch"]["0.2.0"]["state"] == M.S_OFFSET
    assert v["0002-x30.patch"]["0.2.0"]["detail"] == "hunk 1 offset 5"
    conflict = v["0002-x30.patch"]["0.3.0"]
    assert conflict["state"] == M.S_CONFLICTS
    assert "vllm/attn.py hunk #1" in conflict["detail"], conflict
    assert all(v["0003-init.patch"][r]["state"] == M.S_APPLIES for r in ("0.1.0", "0.2.0", "0.3.0"))
    assert doc["apply"][FAKE_BASE]["lmcache"]["0001-core.patch"]["1.0.0"]["state"] == M.S_APPLIES
    assert doc["apply"][FAKE_BASE]["lmcache"]["0001-core.patch"]["1.1.0"]["state"] == M.S_APPLIES
    assert doc["problems"] == [] and M.exit_code(doc) == 0
    assert [r["version"] for r in doc["releases"]["vllm"]] == ["0.1.0", "0.2.0", "0.3.0"]


def test_without_probe_a_reworked_upstream_change_is_a_conflict(fake_repo, tmp_path):
    stack(fake_repo, tmp_path, probe=False)
    cell = matrix(fake_repo)["apply"][FAKE_BASE]["vllm"]["0001-pack.patch"]["0.3.0"]
    assert cell["state"] == M.S_CONFLICTS and "vllm/attn.py hunk #1" in cell["detail"]


def test_empty_series(fake_repo):
    doc = matrix(fake_repo)
    assert doc["apply"] == {FAKE_BASE: {"vllm": {}, "lmcache": {}}}
    assert M.exit_code(doc) == 0
    out = M.render_terminal(doc)
    assert "(empty series)" in out and "the pinned cells are clean" in out


def test_a_patch_that_does_not_apply_to_the_pin_fails_the_run(fake_repo, tmp_path):
    src = pin_tree(fake_repo, "vllm")
    good = make_patch(tmp_path, "vllm/attn.py", "x5 = 5\n", "x5 = 6\n", "five", src)
    add_patch(fake_repo, "vllm", "0001-bad.patch", good.replace("-x5 = 5", "-x5 = 55"))
    res = run(fake_repo, "--suites", "apply", "--out", str(tmp_path / "out"))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "0.1.0 (pin) 0001-bad.patch: conflicts" in res.stdout


def test_probe_errors_and_probe_claiming_the_pin_are_reported(fake_repo, tmp_path):
    stack(fake_repo, tmp_path)
    probes = fake_repo / "ci" / "probes" / "vllm"
    (probes / "0002-x30.py").write_text("def probe(tree):\n    raise RuntimeError('boom')\n")
    (probes / "0003-init.py").write_text("def probe(tree):\n    return True\n")
    doc = matrix(fake_repo)
    cell = doc["apply"][FAKE_BASE]["vllm"]["0002-x30.patch"]["0.2.0"]
    assert cell["state"] == M.S_ERROR and "RuntimeError: boom" in cell["detail"]
    pin = doc["apply"][FAKE_BASE]["vllm"]["0003-init.patch"]["0.1.0"]
    assert pin["state"] == M.S_ERROR and "already upstream in the pin" in pin["detail"]
    assert M.exit_code(doc) == 1


def test_orphan_probe_is_found(fake_repo, tmp_path):
    stack(fake_repo, tmp_path)
    (fake_repo / "ci" / "probes" / "vllm" / "0009-gone.py").write_text("def probe(tree):\n    return False\n")
    (fake_repo / "ci" / "probes" / "vllm" / "_helpers.py").write_text("")
    orphans = M.orphan_probes(fake_repo / "ci" / "probes", series_of(fake_repo))
    assert [p.name for p in orphans] == ["0009-gone.py"]


# --------------------------------------------------------------------------- sources


def test_sdists_are_verified_and_nothing_is_downloaded_when_cached(fake_repo, monkeypatch):
    from kvstack.release import fetch

    def no_network(*a, **k):
        raise AssertionError("tried to download")

    monkeypatch.setattr(fetch, "download_sdist", no_network)
    config = M.load_config(fake_repo / "ci" / "matrix.toml", fake_repo)
    path, digest, how = M.resolve_sdist(config, "vllm", "0.2.0")
    assert how == "ci/matrix.toml [sha256]" and digest == M.sha256_of(path)
    assert M.resolve_sdist(config, "vllm", "0.1.0")[2] == f"vllm/{FAKE_BASE}.env"
    # one byte changed: refused
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(M.SourceError, match="sha256 mismatch"):
        M.resolve_sdist(config, "vllm", "0.2.0")
    # no digest anywhere and offline: refused rather than trusted
    del config.sha256["vllm-0.3.0.tar.gz"]
    with pytest.raises(M.SourceError, match="offline"):
        M.resolve_sdist(config, "vllm", "0.3.0", offline=True)


def test_download_records_the_index_digest(fake_repo, monkeypatch, tmp_path):
    from kvstack.release import fetch

    calls = []
    src = make_sdist(tmp_path / "elsewhere", "vllm", "0.4.0", {"vllm/__init__.py": ""})

    def fake_download(project, version, dest_dir, expected_sha256=None):
        calls.append((project, version, expected_sha256))
        target = Path(dest_dir) / src.name
        target.write_bytes(src.read_bytes())
        return target

    monkeypatch.setattr(fetch, "download_sdist", fake_download)
    config = M.load_config(fake_repo / "ci" / "matrix.toml", fake_repo)
    path, digest, how = M.resolve_sdist(config, "vllm", "0.4.0")
    assert calls == [("vllm", "0.4.0", None)] and how == "index digest"
    assert (path.parent / (path.name + ".sha256")).read_text().strip() == digest
    # the second time: from the cache, verified against the recorded digest, no download
    assert M.resolve_sdist(config, "vllm", "0.4.0", offline=True)[2].startswith("index digest recorded")
    assert len(calls) == 1


# --------------------------------------------------------------------------- other suites


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_pack" name="test_shape"/>
<testcase classname="tests.test_pack" name="test_views"><skipped message="no gpu"/></testcase>
<testcase classname="tests.test_other" name="test_a"/>
<testcase classname="tests.test_other" name="test_b">{fail}</testcase>
</testsuite></testsuites>
"""


def test_results_fill_the_pinned_cell_and_attribute_tests_to_patches(fake_repo, tmp_path):
    stack(fake_repo, tmp_path)
    ok = tmp_path / "unit.xml"
    ok.write_text(JUNIT.format(fail=""))
    bad = tmp_path / "e2e.xml"
    bad.write_text(JUNIT.format(fail='<failure message="x"/>'))
    doc = matrix(fake_repo, suites=M.load_config(fake_repo / "ci" / "matrix.toml", fake_repo).suites,
                 results=[f"unit={ok}", f"e2e-cpu={bad}", "gpu@0.3.0/1.1.0=pass"])
    pin = "0.1.0/1.0.0"
    unit = doc["results"]["unit"]
    assert unit["stack"][pin]["state"] == M.S_PASS and "3 passed, 0 failed, 1 skipped" in unit["stack"][pin]["detail"]
    assert unit["vllm/0001-pack.patch"][pin]["state"] == M.S_PASS
    assert "1 passed" in unit["vllm/0001-pack.patch"][pin]["detail"]
    e2e = doc["results"]["e2e-cpu"]
    assert e2e["stack"][pin]["state"] == M.S_FAIL and "tests.test_other::test_b" in e2e["stack"][pin]["detail"]
    assert e2e["vllm/0001-pack.patch"][pin]["state"] == M.S_PASS  # the failure is not this patch's test
    other = unit["stack"]["0.3.0/1.0.0"]
    assert other["state"] == M.S_NOT_RUN and "no environment" in other["detail"]
    assert "the stack does not apply there" in other["detail"]  # 0002 conflicts on 0.3.0
    assert doc["results"]["gpu"]["stack"]["0.3.0/1.1.0"]["state"] == M.S_PASS
    assert doc["results"]["gpu"]["stack"][pin]["state"] == M.S_NOT_RUN
    assert M.exit_code(doc) == 1 and any("e2e-cpu" in p for p in doc["problems"])


def test_results_for_unknown_cells_or_suites_are_usage_errors(fake_repo, tmp_path):
    res = run(fake_repo, "--results", "unit@9.9.9=pass", "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and "no such cell" in res.stderr
    res = run(fake_repo, "--results", "apply=pass", "--out", str(tmp_path / "o"))
    assert res.returncode == 2


# --------------------------------------------------------------------------- outputs


def test_cli_writes_report_json_html_and_keeps_hand_written_text(fake_repo, tmp_path):
    stack(fake_repo, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "REPORT.md").write_text(f"# Matrix\n\nintro\n\n{M.REPORT_BEGIN}\nold\n{M.REPORT_END}\n\n## Hand check\n\nkept\n")
    res = run(fake_repo, "--out", str(out), "--results", "unit=pass")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0001-pack.patch" in res.stdout and "upstream (probe)" in res.stdout
    report = (out / "REPORT.md").read_text(encoding="utf-8")
    assert report.startswith("# Matrix\n\nintro\n") and report.rstrip().endswith("kept")
    assert "\nold\n" not in report and report.count(M.REPORT_BEGIN) == 1
    assert "| `0002-x30.patch` | ✅ applies | ☑️ applies with offset | ❌ conflicts |" in report
    assert "vllm/attn.py hunk #1" in report
    assert "`vllm >= 0.2.0`" in report  # the upstream-status proposal for 0001
    doc = json.loads((out / "matrix.json").read_text())
    assert doc["schema"] == M.SCHEMA and "tree" not in doc["releases"]["vllm"][0]
    page = (out / "matrix.html").read_text(encoding="utf-8")
    assert M.COLORS[M.S_CONFLICTS] in page and "vLLM 0.1.0" in page and "pin of base 0.1" in page and "LMCache 1.1.0" in page
    # columns: every (vLLM, LMCache) pair; rows: patch x suite
    g = M.grid(doc)
    assert len(g["columns"]) == 3 * 2
    assert [r["suite"] for r in g["rows"]].count("apply") == 4


def test_png_when_matplotlib_is_available(tmp_path):
    import importlib.util

    venv_py = cache_dir() / "plot-venv" / "bin" / "python"
    if importlib.util.find_spec("matplotlib") is None and not venv_py.exists():
        pytest.skip("no matplotlib here and no plot venv cached (the runner installs one on first use)")
    doc = {"generated": "now", "suites": ["apply"], "pins": {"vllm": "1", "lmcache": "2"},
           "bases": {"1": {"label": "1", "pins": {"vllm": "1", "lmcache": "2"}}},
           "series": {"1": {"vllm": "present", "lmcache": "absent"}},
           "cells": [{"key": "1/2", "vllm": "1", "lmcache": "2", "pinned": True, "pin_of": "1"}],
           "apply": {"1": {"vllm": {"0001-a.patch": {"1": {"state": M.S_APPLIES, "detail": "", "how": "", "note": ""}}},
                           "lmcache": {}}},
           "results": {}, "problems": [], "releases": {}}
    assert M.render_png(doc, tmp_path / "m.png")
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- upstream-status


def test_upstream_status_proposals(fake_repo, tmp_path):
    stack(fake_repo, tmp_path)
    doc = matrix(fake_repo)
    props = {p.patch: p for p in M.proposals(doc)}
    pack = props["0001-pack.patch"]
    # the header claims 0.2.0, the matrix agrees on Upstream-Status; Drop-When is missing
    assert pack.status == "Backport [vllm-project/vllm#44455, in 0.2.0]"
    assert pack.drop == "vllm >= 0.2.0" and pack.verdict == "update"
    x30 = props["0002-x30.patch"]
    assert x30.status == "Pending" and x30.drop == "upstream has it (not in vLLM <= 0.3.0)"
    assert any("conflicts from vLLM 0.3.0" in r for r in x30.reasons)


def test_upstream_status_flags_wrong_claims_and_mixed_results():
    def cells(**states):
        return {v.replace("_", "."): {"state": s, "how": "probe" if s == M.S_UPSTREAM else ""}
                for v, s in states.items()}

    # claims a checked release has it, none has: CHECK
    p = U.propose("vllm", "a.patch", cells(v0_1_0=M.S_APPLIES, v0_2_0=M.S_CONFLICTS, v0_3_0=M.S_APPLIES),
                  "0.1.0", "Backport [#1, in 0.2.0]", "vllm >= 0.2.0")
    assert p.verdict == "CHECK"
    # upstream in 0.2.0 but not in 0.3.0: CHECK
    p = U.propose("vllm", "a.patch", cells(v0_1_0=M.S_APPLIES, v0_2_0=M.S_UPSTREAM, v0_3_0=M.S_APPLIES),
                  "0.1.0", "Pending", None)
    assert p.verdict == "CHECK"
    # an unchecked release between the previous checked one and the first that has it agrees
    p = U.propose("vllm", "a.patch", cells(v0_1_0=M.S_APPLIES, v0_2_0=M.S_APPLIES, v0_4_1=M.S_UPSTREAM),
                  "0.1.0", "Backport [#3, merged for 0.4.0]", "vllm >= 0.4.0")
    assert p.verdict == "ok", p.reasons
    # an author's own Drop-When text is kept while nothing is upstream
    p = U.propose("vllm", "a.patch", cells(v0_1_0=M.S_APPLIES, v0_2_0=M.S_APPLIES), "0.1.0", "Submitted [#4]", "never")
    assert p.verdict == "ok" and p.drop == "never"
    # a kvstack-only change is never dropped for an upstream release
    p = U.propose("vllm", "a.patch", cells(v0_1_0=M.S_APPLIES, v0_2_0=M.S_APPLIES), "0.1.0", "Inappropriate [ours]", None)
    assert p.verdict == "update" and p.drop == "never (kvstack-only change)"


def test_upstream_status_write_changes_only_the_header(fake_repo, tmp_path):
    stack(fake_repo, tmp_path)
    out = tmp_path / "out"
    assert run(fake_repo, "--suites", "apply", "--out", str(out)).returncode == 0
    vdir = fake_repo / "patches" / FAKE_BASE / "vllm"
    before = {p.name: p.read_text() for p in vdir.glob("*.patch")}
    args = ["--matrix", str(out / "matrix.json"), "--series-dir", f"vllm={vdir}",
            "--series-dir", f"lmcache={fake_repo / 'patches' / FAKE_BASE / 'lmcache'}", "--no-run", "--component", "vllm"]
    assert U.main(args + ["--check"]) == 1
    assert U.main(args + ["--write"]) == 0
    after = (vdir / "0001-pack.patch").read_text()
    assert "\nUpstream-Status: Backport [vllm-project/vllm#44455, in 0.2.0]\nDrop-When: vllm >= 0.2.0\n---\n" in after
    for name, text in before.items():
        new = (vdir / name).read_text()
        assert new.split("\n---\n", 1)[1] == text.split("\n---\n", 1)[1], "the diff must not change"
    # header edits do not make the matrix result stale, and now every header agrees
    assert U.main(args + ["--check"]) == 0
    res = subprocess.run(["git", "apply", "--check", str(vdir / "0001-pack.patch")], cwd=pin_tree(fake_repo, "vllm"),
                         env={**os.environ, "GIT_DIR": os.devnull}, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_set_fields_adds_lines_before_the_diffstat():
    text = "From 0 Mon\nSubject: [PATCH] x\n\nWhy.\n---\n a | 1 +\n\ndiff --git a/a b/a\n"
    new = U.set_fields(text, {"Upstream-Status": "Pending", "Drop-When": "never"})
    assert new == "From 0 Mon\nSubject: [PATCH] x\n\nWhy.\n\nUpstream-Status: Pending\nDrop-When: never\n---\n a | 1 +\n\ndiff --git a/a b/a\n"


# --------------------------------------------------------------------------- the real repository


def test_every_probe_belongs_to_a_patch_and_is_loadable():
    probes = REPO / "ci" / "probes"
    # probes are keyed by patch name: a probe belongs to a patch of some base's series
    series = {c: [p for b in base_names() for p in read_series(load_pin(c, b).series_dir)] for c in COMPONENTS}
    assert M.orphan_probes(probes, series) == []
    for comp in COMPONENTS:
        for patch in series[comp]:
            probe = M.load_probe(probes, comp, patch)
            if probe is not None:
                assert not probe.error, f"{probe.path}: {probe.error}"
                assert probe.func is not None or probe.tests, f"{probe.path} defines neither probe() nor TESTS"


def test_real_series_on_the_cached_pins():
    """The real stack against the real pinned sdists (skips unless they are cached): clean pinned cells."""
    config = M.load_config()
    for comp in COMPONENTS:
        if not (cache_dir() / "sdists" / load_pin(comp).sdist).is_file():
            pytest.skip(f"the pinned {comp} sdist is not cached (scripts/fetch_sources.sh fetches it)")
    series = {c: read_series(load_pin(c).series_dir) for c in COMPONENTS}
    doc = M.run_matrix(config, ["apply"], series, REPO / "ci" / "probes", [], offline=True,
                       releases_filter={c: [config.pins[c]] for c in COMPONENTS})
    assert [r["version"] for r in doc["releases"]["vllm"]] == [config.pins["vllm"]]
    assert doc["problems"] == [], doc["problems"]
    # a fixture patch made against the real pinned tree applies there (the real-release path end to end)
    tree = M.release_tree(config, "vllm", config.pins["vllm"], offline=True)[0]
    assert (tree / "vllm" / "__init__.py").is_file() and (tree / M.TREE_STAMP).is_file()


def test_committed_report_has_the_generated_table_and_the_hand_check():
    report = (REPO / "ci" / "REPORT.md").read_text(encoding="utf-8")
    assert report.count(M.REPORT_BEGIN) == 1 and report.count(M.REPORT_END) == 1
    assert "Hand check" in report and report.count("git apply") >= 3
    for v in M.load_config().releases["vllm"]:
        assert v in report
    assert (REPO / "ci" / "matrix.json").is_file()
    assert (REPO / "ci" / "matrix.png").is_file() or (REPO / "ci" / "matrix.html").is_file()


def test_workflow_runs_the_matrix_on_a_schedule():
    wf = (REPO / ".github" / "workflows" / "matrix.yml").read_text()
    assert "schedule:" in wf and "cron:" in wf and "ci/run_matrix.py" in wf


def test_probes_can_share_helpers(fake_repo, tmp_path):
    stack(fake_repo, tmp_path, probe=False)
    probes = fake_repo / "ci" / "probes"
    (probes / "_fakelib.py").write_text("def packed(tree):\n    return '2 * d' in (tree / 'vllm/attn.py').read_text()\n")
    (probes / "vllm").mkdir(exist_ok=True)
    (probes / "vllm" / "0001-pack.py").write_text("from _fakelib import packed as probe\n")
    cell = matrix(fake_repo)["apply"][FAKE_BASE]["vllm"]["0001-pack.patch"]["0.3.0"]
    assert cell["state"] == M.S_UPSTREAM and cell["how"] == "probe"


PROBELIB_EXPECTED = {  # REFERENCE.md's upstream facts, per release
    "vllm_packed_kv": {"0.25.1": False, "0.26.0": True, "0.27.1": True, "0.29.0": True, "0.32.0": True, "0.33.0": True},
    "vllm_bind_kv_cache": {"0.25.1": False, "0.26.0": False, "0.27.1": True, "0.29.0": True, "0.32.0": True,
                           "0.33.0": True},
    "vllm_layout_api": {"0.25.1": False, "0.26.0": False, "0.27.1": False, "0.29.0": True, "0.32.0": True,
                        "0.33.0": True},
    "vllm_lmcache_connector_hma": {v: False for v in ("0.25.1", "0.26.0", "0.27.1", "0.29.0", "0.32.0", "0.33.0")},
    "vllm_merge_attn_states_cpu": {"0.25.1": False, "0.26.0": False, "0.27.1": False, "0.29.0": True, "0.32.0": True,
                                   "0.33.0": True},
}


@pytest.mark.parametrize("version", ["0.25.1", "0.26.0", "0.27.1", "0.29.0", "0.32.0", "0.33.0"])
def test_probelib_against_the_real_releases(version):
    """The shared probe checks agree with REFERENCE.md on each cached release sdist (skips if not cached)."""
    config = M.load_config()
    names = [n for n in M._sdist_names("vllm", version) if (cache_dir() / "sdists" / n).is_file()]
    if not names:
        pytest.skip(f"vllm {version} sdist not cached (python3 ci/run_matrix.py --suites apply fetches it)")
    tree = M.release_tree(config, "vllm", version, offline=True)[0]
    sys.path.insert(0, str(REPO / "ci" / "probes"))
    try:
        import _probelib
    finally:
        sys.path.remove(str(REPO / "ci" / "probes"))
    got = {name: getattr(_probelib, name)(tree) for name in PROBELIB_EXPECTED}
    assert got == {name: per[version] for name, per in PROBELIB_EXPECTED.items()}


def diff_patch(tmp: Path, rel: str, old: str, new: str, subject: str, status: str) -> str:
    """A format-patch style patch turning old into new at rel."""
    work = tmp / f"diff-{abs(hash((rel, subject))) % 10**8}"
    for side, text in (("a", old), ("b", new)):
        (work / side / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / side / rel).write_text(text)
    diff = subprocess.run(["git", "diff", "--no-index", "--no-prefix", "--full-index", f"a/{rel}", f"b/{rel}"],
                          cwd=work, capture_output=True, text=True).stdout
    return ("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
            "From: kvstack test <kvstack@localhost>\nDate: Sat, 1 Jan 2000 00:00:00 +0000\n"
            f"Subject: [PATCH] {subject}\n\nA fixture patch made by the tests.\n\nUpstream-Status: {status}\n"
            f"---\n{diff}--\n2.39.5\n\n")


def test_real_releases_with_a_demonstration_series(tmp_path):
    """Every apply state on the real vLLM releases (skips unless all their sdists are cached).

    0001 is upstream's own 0.25.1 -> 0.26.0 change of flash_attn.py (the packed K/V layout), so it
    applies to the pin, reverse-applies to 0.26.0, and conflicts from 0.27.1 on, where upstream kept
    changing the file: there only the probe (_probelib.vllm_packed_kv) can tell it is upstream.
    0002 adds a comment to vllm/envs.py and applies everywhere. Run as base 0.25's series (its pin
    is 0.25.1, where the demonstration patches are made).
    """
    config = M.load_config(base="0.25")
    versions = config.releases["vllm"]
    for v in versions:
        if not any((cache_dir() / "sdists" / n).is_file() for n in M._sdist_names("vllm", v)):
            pytest.skip(f"vllm {v} sdist not cached (python3 ci/run_matrix.py --suites apply fetches it)")
    trees = {v: M.release_tree(config, "vllm", v, offline=True)[0] for v in versions}
    rel = "vllm/v1/attention/backends/flash_attn.py"
    series_dir = tmp_path / "series"
    series_dir.mkdir()
    (series_dir / "0001-demo-packed.patch").write_text(
        diff_patch(tmp_path, rel, (trees["0.25.1"] / rel).read_text(), (trees["0.26.0"] / rel).read_text(),
                   "demo: packed K/V in flash_attn", "Backport [vllm-project/vllm#44455]"))
    (series_dir / "0002-demo-envs.patch").write_text(
        make_patch(tmp_path, "vllm/envs.py", "import os\n", "import os  # kvstack demo\n", "demo: envs",
                   trees["0.25.1"]))
    series = {"vllm": [series_dir / "0001-demo-packed.patch", series_dir / "0002-demo-envs.patch"], "lmcache": []}
    probes = tmp_path / "probes"
    (probes / "vllm").mkdir(parents=True)
    (probes / "_probelib.py").write_text((REPO / "ci" / "probes" / "_probelib.py").read_text())

    without = M.run_matrix(config, ["apply"], series, probes, [], components=["vllm"], offline=True)
    (probes / "vllm" / "0001-demo-packed.py").write_text("from _probelib import vllm_packed_kv as probe\n")
    with_probe = M.run_matrix(config, ["apply"], series, probes, [], components=["vllm"], offline=True)

    a0, a1 = without["apply"][config.base]["vllm"]["0001-demo-packed.patch"], with_probe["apply"][config.base]["vllm"]["0001-demo-packed.patch"]
    assert a0["0.25.1"]["state"] == a1["0.25.1"]["state"] == M.S_APPLIES
    assert a0["0.26.0"]["state"] == M.S_UPSTREAM and a0["0.26.0"]["how"] == "reverse-applies"
    for v in versions[2:]:
        assert a0[v]["state"] == M.S_CONFLICTS and rel in a0[v]["detail"], (v, a0[v])
        assert a1[v]["state"] == M.S_UPSTREAM and a1[v]["how"] == "probe", (v, a1[v])
    for v in versions:
        assert with_probe["apply"][config.base]["vllm"]["0002-demo-envs.patch"][v]["state"] in (M.S_APPLIES, M.S_OFFSET)
    assert without["problems"] == [] and with_probe["problems"] == []
    prop = {p.patch: p for p in M.proposals(with_probe)}["0001-demo-packed.patch"]
    assert prop.drop == "vllm >= 0.26.0"
    assert prop.status == "Backport [vllm-project/vllm#44455, upstream in vLLM 0.26.0]"


# --------------------------------------------------------------------------- two bases, results per base


def add_second_base(root: Path, tmp_path: Path) -> None:
    """Base 0.3 (vllm 0.3.0 + lmcache 1.1.0) with one vLLM patch made against 0.3.0, no LMCache series yet."""
    config = M.load_config(root / "ci" / "matrix.toml", root)
    for comp, v in (("vllm", "0.3.0"), ("lmcache", "1.1.0")):
        name = f"{comp}-{v}.tar.gz"
        (root / comp / "0.3.env").write_text(
            f"PROJECT={comp}\nVERSION={v}\nSDIST={name}\nSDIST_SHA256={config.sha256[name]}\n")
    (root / "patches" / "0.3" / "vllm").mkdir(parents=True)
    (root / "patches" / "0.3" / "vllm" / "series").write_text("")
    tree = M.release_tree(config, "vllm", "0.3.0", offline=True)[0]
    add_patch(root, "vllm", "0001-x30-rebased.patch",
              make_patch(tmp_path, "vllm/attn.py", "x29 = 29\nx30 = 300\n", "x29 = 29\nx30 = 31\n", "x30 rebased", tree)
              .replace("Inappropriate [test fixture]", "Pending"), base="0.3")


def test_each_base_series_is_checked_against_every_release(fake_repo, tmp_path):
    stack(fake_repo, tmp_path)
    add_second_base(fake_repo, tmp_path)
    out = tmp_path / "out"
    res = run(fake_repo, "--suites", "apply", "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads((out / "matrix.json").read_text())
    assert doc["schema"] == 2 and sorted(doc["bases"]) == ["0.1", "0.3"] and doc["base"] == "0.1"
    assert doc["series"]["0.3"] == {"vllm": "present", "lmcache": "absent"}
    new = doc["apply"]["0.3"]["vllm"]["0001-x30-rebased.patch"]
    assert new["0.3.0"]["state"] == M.S_APPLIES  # its own pin
    assert new["0.1.0"]["state"] == M.S_CONFLICTS and new["0.2.0"]["state"] == M.S_CONFLICTS
    assert doc["apply"]["0.1"]["vllm"]["0002-x30.patch"]["0.3.0"]["state"] == M.S_CONFLICTS  # not a problem: not its pin
    assert doc["apply"]["0.3"]["lmcache"] == {}
    assert "0.3.0 (pin of base 0.3)" in res.stdout and "0.1.0 (pin of base 0.1)" in res.stdout
    assert "(no series yet)" in res.stdout
    report = (out / "REPORT.md").read_text(encoding="utf-8")
    assert "### apply, base 0.3 (vLLM 0.3.0 + LMCache 1.1.0): its vLLM series x vLLM releases" in report
    assert "no series yet (patches/0.3/lmcache/series)" in report
    # the new base's series must apply to its own pin
    (fake_repo / "patches" / "0.3" / "vllm" / "0001-x30-rebased.patch").write_text(
        (fake_repo / "patches" / "0.1" / "vllm" / "0002-x30.patch").read_text())
    res = run(fake_repo, "--suites", "apply", "--out", str(out))
    assert res.returncode == 1 and "base 0.3: vllm 0.3.0 (pin) 0001-x30-rebased.patch: conflicts" in res.stdout


SPLIT_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.tooling.test_x" name="test_a" file="tests/tooling/test_x.py"/>
<testcase classname="tests.env.streaming.test_y" name="test_b"/>
<testcase classname="tests.env.lmcache.test_z" name="test_c">{fail}</testcase>
</testsuite></testsuites>
"""


def test_results_files_fill_the_pinned_pair_of_their_base_split_into_unit_and_e2e(fake_repo, tmp_path):
    stack(fake_repo, tmp_path)
    add_second_base(fake_repo, tmp_path)
    toml = fake_repo / "ci" / "matrix.toml"
    toml.write_text(toml.read_text() + '\n[suite.e2e-cpu]\njunit_cases = ["tests.env.*"]\n')
    junit = tmp_path / "junit"
    junit.mkdir()
    (junit / "tests-0.1.xml").write_text(SPLIT_JUNIT.format(fail=""))
    only_env = SPLIT_JUNIT.format(fail='<failure message="x"/>').replace(
        '<testcase classname="tests.tooling.test_x" name="test_a" file="tests/tooling/test_x.py"/>\n', "")
    (junit / "tests-0.3.xml").write_text(only_env)
    out = tmp_path / "out"
    res = run(fake_repo, "--out", str(out), "--results", f"unit={junit / 'tests-0.1.xml'}",
              "--results", f"unit={junit / 'tests-0.3.xml'}")
    assert res.returncode == 1, res.stdout + res.stderr  # the 0.3 e2e case failed
    doc = json.loads((out / "matrix.json").read_text())
    unit, e2e = doc["results"]["unit"]["stack"], doc["results"]["e2e-cpu"]["stack"]
    assert unit["0.1.0/1.0.0"]["state"] == M.S_PASS and "1 passed, 0 failed" in unit["0.1.0/1.0.0"]["detail"]
    assert e2e["0.1.0/1.0.0"]["state"] == M.S_PASS and "2 passed, 0 failed" in e2e["0.1.0/1.0.0"]["detail"]
    assert e2e["0.3.0/1.1.0"]["state"] == M.S_FAIL and "tests.env.lmcache.test_z::test_c" in e2e["0.3.0/1.1.0"]["detail"]
    assert unit["0.3.0/1.1.0"]["state"] == M.S_NOT_RUN and "no unit test case in tests-0.3.xml" in unit["0.3.0/1.1.0"]["detail"]
    assert {c["key"]: c["pin_of"] for c in doc["cells"] if c["pin_of"]} == {"0.1.0/1.0.0": "0.1", "0.3.0/1.1.0": "0.3"}
    assert unit["0.2.0/1.0.0"]["state"] == M.S_NOT_RUN
    assert "0.1.0/1.0.0 (pin of base 0.1)" in res.stdout and "0.3.0/1.1.0 (pin of base 0.3)" in res.stdout
    # no results for a base: its pinned cells say so
    res = run(fake_repo, "--out", str(out), "--results", f"unit={junit / 'tests-0.1.xml'}")
    doc = json.loads((out / "matrix.json").read_text())
    assert "no results given for base 0.3" in doc["results"]["unit"]["stack"]["0.3.0/1.1.0"]["detail"]


# --------------------------------------------------------------------------- a pin bump: --propose-base


def test_propose_base_reports_each_patch_and_writes_only_with_write(fake_repo, tmp_path):
    """Propose vLLM 0.3.0 + LMCache 1.1.0 from base 0.1: 0001 upstream (probe), 0002 conflicts, 0003 applies."""
    stack(fake_repo, tmp_path)
    before = {p: p.read_bytes() for p in fake_repo.rglob("*") if p.is_file()}
    res = run(fake_repo, "--propose-base", "0.3.0", "1.1.0")
    assert res.returncode == 1, res.stdout + res.stderr  # 0002 conflicts: a rebase is due
    out = res.stdout
    assert "propose base 0.3: vLLM 0.3.0 + LMCache 1.1.0, checked against the series of base 0.1" in out
    assert re.search(r"0001-pack\.patch  already upstream \(probe\)", out)
    assert re.search(r"0002-x30\.patch  CONFLICTS: vllm/attn\.py hunk #1", out)
    assert re.search(r"0003-init\.patch  applies", out)
    assert re.search(r"0001-core\.patch  applies", out)
    assert re.search(r"Drop-When candidates.*\n  vllm/0001-pack\.patch  \(probe\)  Drop-When: \(none\)", out)
    digest = M.load_config(fake_repo / "ci" / "matrix.toml", fake_repo).sha256["vllm-0.3.0.tar.gz"]
    assert f"SDIST_SHA256={digest}" in out and "vllm/0.3.env (suggested)" in out
    assert "nothing written" in out
    assert {p: p.read_bytes() for p in fake_repo.rglob("*") if p.is_file()} == before
    # --write: the pin files (valid KEY=VALUE) and nothing else but ci/matrix.toml lines that are missing
    res = run(fake_repo, "--propose-base", "0.3.0", "1.1.0", "--write")
    assert "wrote: vllm/0.3.env, lmcache/0.3.env" in res.stdout, res.stdout + res.stderr
    from kvstack.release.pins import load_base
    assert load_base("0.3", fake_repo).label == "0.3 (vLLM 0.3.0 + LMCache 1.1.0)"
    assert load_pin("vllm", "0.3", fake_repo).sdist_sha256 == digest
    assert (fake_repo / "ci" / "matrix.toml").read_bytes() == before[fake_repo / "ci" / "matrix.toml"]
    assert run(fake_repo, "--propose-base", "0.3.0", "1.1.0", "--write").returncode == 2  # exists: refused


def test_propose_base_adds_the_toml_lines_for_a_new_release(fake_repo, tmp_path, monkeypatch):
    src = make_sdist(tmp_path / "new", "vllm", "0.4.0", {"vllm/__init__.py": "", "vllm/attn.py": attn("0.1.0")})
    target = cache_dir() / "sdists" / src.name
    target.write_bytes(src.read_bytes())
    digest = M.sha256_of(target)
    target.with_name(target.name + ".sha256").write_text(digest + "\n")  # as a first download leaves it
    stack(fake_repo, tmp_path)
    res = run(fake_repo, "--propose-base", "0.4.0", "1.0.0", "--write")
    assert res.returncode == 0, res.stdout + res.stderr
    assert '[vllm] releases: add "0.4.0"' in res.stdout and f'[sha256]: "vllm-0.4.0.tar.gz" = "{digest}"' in res.stdout
    config = M.load_config(fake_repo / "ci" / "matrix.toml", fake_repo)
    assert "0.4.0" in config.releases["vllm"] and config.sha256["vllm-0.4.0.tar.gz"] == digest
    assert config.bases["0.4"] == {"vllm": "0.4.0", "lmcache": "1.0.0"}


def test_propose_base_on_the_real_cached_releases():
    """0.33.0 + 0.5.6 from base 0.32, on the cached sdists: the report names each 0.32 patch's state."""
    from kvstack.matrix import propose_base as P

    for name in ("vllm-0.33.0.tar.gz", "lmcache-0.5.6.tar.gz"):
        if not (cache_dir() / "sdists" / name).is_file():
            pytest.skip(f"{name} not cached (python3 ci/run_matrix.py --suites apply fetches it)")
    report = P.propose_base("0.33.0", "0.5.6", "0.32", offline=True)
    text = P.render(report)
    assert report["problems"] == [], report["problems"]
    assert report["new_base"] == "0.33" and "nothing written" in text
    for comp in COMPONENTS:
        series_dir = load_pin(comp, "0.32").series_dir
        if not (series_dir / "series").is_file():
            assert report["series"][comp] == "absent" and "no series yet (patches/0.32/" in text
            continue
        for patch in read_series(series_dir):
            row = next(r for r in report["patches"][comp] if r["name"] == patch.name)
            assert row["state"] in (M.S_APPLIES, M.S_OFFSET, M.S_CONFLICTS, M.S_UPSTREAM), row
            assert re.search(rf"{re.escape(patch.name)}  (applies|applies with offset|CONFLICTS|already upstream)", text)
    # LMCache 0.5.6 is base 0.32's pin: its wheel lines are known and copied, not TODO
    assert "WHEEL_CP311_SHA256=" in report["pin_files"]["lmcache"] and "TODO" not in report["pin_files"]["lmcache"]
    assert "# TODO CUDA_WHEEL=vllm-0.33.0-" in report["pin_files"]["vllm"]


def test_a_cell_whose_tests_all_skipped_is_skipped_not_pass(fake_repo, tmp_path):
    """A pass needs at least one test that ran and none that failed: a results file in which every
    test of a cell (or of a patch's row) was skipped shows "skipped", never pass."""
    from kvstack.matrix.results import TestCase, summarize

    skipped = [TestCase("tests.test_pack", "test_views", "", "skipped")] * 3
    cell = summarize(skipped, "x.xml")
    assert cell.state == M.S_SKIPPED and "none ran" in cell.detail
    assert summarize(skipped + [TestCase("t", "a", "", "passed")], "x.xml").state == M.S_PASS
    stack(fake_repo, tmp_path)
    allskip = tmp_path / "unit.xml"
    allskip.write_text(JUNIT.format(fail="").replace(
        '"/>\n<testcase', '"><skipped message="no env"/></testcase>\n<testcase').replace(
        'name="test_b"></testcase>', 'name="test_b"><skipped message="no env"/></testcase>'))
    doc = matrix(fake_repo, suites=M.load_config(fake_repo / "ci" / "matrix.toml", fake_repo).suites,
                 results=[f"unit={allskip}"])
    unit = doc["results"]["unit"]["stack"]["0.1.0/1.0.0"]
    assert unit["state"] == M.S_SKIPPED, unit
    assert M.S_SKIPPED in M.STATES and M.S_SKIPPED in M.COLORS and M.S_SKIPPED in M.MD_MARK


def test_the_committed_report_is_the_generators_output_of_the_committed_json():
    """ci/REPORT.md's generated section is render_markdown(ci/matrix.json): never edited by hand
    (`python3 ci/run_matrix.py --publish --results ...` writes both; `--rerender ci/matrix.json
    --publish` writes the report again from the JSON). It names the commit and date it came from."""
    from kvstack.matrix.render.markdown import REPORT_BEGIN, REPORT_END, render_markdown

    doc = json.loads((REPO / "ci" / "matrix.json").read_text())
    text = (REPO / "ci" / "REPORT.md").read_text()
    committed = REPORT_BEGIN + text.split(REPORT_BEGIN, 1)[1].split(REPORT_END, 1)[0] + REPORT_END
    assert committed.strip() == render_markdown(doc).strip(), (
        "ci/REPORT.md differs from the rendering of ci/matrix.json: run `python3 ci/run_matrix.py "
        "--rerender ci/matrix.json --publish` (or `make matrix`) and commit both")
    assert doc.get("commit") and doc.get("generated") and doc.get("command")
    assert f"at commit `{doc['commit']}`" in committed and doc["generated"] in committed


def test_rerender_writes_the_report_from_a_json(tmp_path):
    doc = json.loads((REPO / "ci" / "matrix.json").read_text())
    doc.update(commit="abc123", command="python3 ci/run_matrix.py --publish")
    (tmp_path / "m.json").write_text(json.dumps(doc))
    res = subprocess.run([sys.executable, "ci/run_matrix.py", "--rerender", str(tmp_path / "m.json"),
                          "--out", str(tmp_path / "out"), "--no-png"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    report = (tmp_path / "out" / "REPORT.md").read_text()
    assert "at commit `abc123` by `python3 ci/run_matrix.py --publish`" in report
    assert (tmp_path / "out" / "matrix.html").is_file()
