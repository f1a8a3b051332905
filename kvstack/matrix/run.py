"""One run of the matrix: configuration + each base's series + results in, the matrix document out.

The document (a dict, schema 2; written as matrix.json) holds::

    bases     base -> {label, pins: {component: version}, default: bool}
    series    base -> component -> "present" / "absent" (no patches/<base>/<component>/series yet)
    patches   base -> component -> [patch info: name, sha256, diff_sha256, subject, trailers]
    probes    base -> component -> patch -> {file, probe, tests, error}
    apply     base -> component -> patch -> release -> cell       (the apply suite)
    releases  component -> [{version, pin_of: [bases], sha256, verified_by}]
    cells     [{key "VLLM/LMCACHE", vllm, lmcache, pin_of: base or None}]   (the other suites' columns)
    results   suite -> row ("stack", or "component/patch" for a probe's TESTS) -> cell key -> cell
    problems  what makes the exit code 1
"""

from __future__ import annotations

import datetime as _dt
import fnmatch
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict
from pathlib import Path

from kvstack.matrix.apply_suite import apply_release, patch_info
from kvstack.matrix.config import Config
from kvstack.matrix.probes import load_probe, orphan_probes
from kvstack.matrix.results import ResultSpec, TestCase, cell_key, matches, read_junit, summarize
from kvstack.matrix.sdists import SourceError, release_tree
from kvstack.matrix.states import (S_APPLIES, S_CONFLICTS, S_ERROR, S_FAIL, S_NOT_RUN, S_OFFSET, S_PASS, SCHEMA, Cell,
                                   log)
from kvstack.release.pins import COMPONENTS

Series = dict[str, "list[Path] | None"]  # component -> patch files in order; None: no series file yet


def _by_base(config: Config, series: dict) -> dict[str, Series]:
    """series as {base: {component: patches}}; a plain {component: patches} is the config's base."""
    if all(k in COMPONENTS for k in series):
        return {config.base: series}
    return series


def _base_label(name: str, pins: dict[str, str]) -> str:
    return f"{name} (vLLM {pins.get('vllm')} + LMCache {pins.get('lmcache')})"


def run_matrix(config: Config, suites: list[str], series: dict, probes_dir: Path,
               results: list[ResultSpec], components: list[str] | None = None, offline: bool = False,
               releases_filter: dict[str, list[str]] | None = None) -> dict:
    """series: {component: [patch]} (the config's base) or {base: {component: [patch] or None}}."""
    started = time.monotonic()
    components = components or list(COMPONENTS)
    by_base = _by_base(config, series)
    run_bases = list(by_base)
    for b in run_bases:
        if b not in config.bases:
            raise ValueError(f"unknown base {b!r} (the bases are: {', '.join(config.bases)})")
    kept_pins = {c: {config.bases[b][c] for b in run_bases} for c in components}
    releases = {c: [v for v in config.releases[c] if not releases_filter or c not in releases_filter
                    or v in releases_filter[c] or v in kept_pins[c]] for c in components}
    doc: dict = {
        "schema": SCHEMA,
        "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "config": Path(config.path).name if config.path else "",
        "base": config.base if config.base in by_base else run_bases[0],
        "pins": dict(config.bases.get(config.base if config.base in by_base else run_bases[0], config.pins)),
        "bases": {b: {"label": _base_label(b, config.bases[b]), "pins": dict(config.bases[b]),
                      "default": b == config.base} for b in run_bases},
        "suites": suites,
        "releases": {c: [] for c in components},
        "series": {b: {} for b in run_bases},
        "patches": {b: {} for b in run_bases},
        "probes": {b: {} for b in run_bases},
        "apply": {b: {} for b in run_bases},
        "results": {},
        "problems": [],
    }
    for comp in components:
        trees: dict[str, tuple] = {}
        for version in releases[comp]:
            info = {"version": version, "pin_of": [b for b in config.pin_of(comp, version) if b in by_base]}
            info["pinned"] = bool(info["pin_of"])
            if "apply" in suites:
                try:
                    tree, digest, how = release_tree(config, comp, version, offline)
                    info.update({"sha256": digest, "verified_by": how, "tree": str(tree)})
                    trees[version] = (tree, None)
                except Exception as err:
                    if not isinstance(err, SourceError):
                        err = f"{type(err).__name__}: {err}"
                    info["error"] = str(err)
                    trees[version] = (None, str(err))
                    doc["problems"].append(f"{comp} {version}: {err}")
            doc["releases"][comp].append(info)
        for base, per_comp in by_base.items():
            patches = per_comp.get(comp)
            doc["series"][base][comp] = "absent" if patches is None else "present"
            patches = patches or []
            present = [p for p in patches if p.is_file()]
            for p in patches:
                if not p.is_file():
                    doc["problems"].append(f"base {base}: the {comp} series names a missing patch file {p}")
            doc["patches"][base][comp] = [patch_info(p) for p in present]
            doc["probes"][base][comp] = {}
            probes = {}
            for p in present:
                pr = load_probe(probes_dir, comp, p)
                if pr is not None:
                    probes[p] = pr
                    doc["probes"][base][comp][p.name] = {"file": f"{comp}/{pr.path.name}",
                                                         "probe": pr.func is not None, "tests": pr.tests,
                                                         "error": pr.error}
            doc["apply"][base][comp] = {p.name: {} for p in present}
            if "apply" not in suites:
                continue
            pin = config.bases[base][comp]
            for version in releases[comp]:
                pinned = version == pin
                tree, err = trees[version]
                if tree is None:
                    cells = {p.name: Cell(S_ERROR, err) for p in present}
                else:
                    try:
                        cells = apply_release(comp, tree, present, probes, pinned)
                    except Exception as exc:
                        msg = f"{type(exc).__name__}: {exc}"
                        cells = {p.name: Cell(S_ERROR, msg) for p in present}
                for name, cell in cells.items():
                    doc["apply"][base][comp][name][version] = asdict(cell)
                    if cell.state == S_ERROR:
                        if tree is not None:
                            doc["problems"].append(f"base {base}: {comp} {version} {name}: {cell.detail}")
                    elif pinned and cell.state not in (S_APPLIES, S_OFFSET):
                        doc["problems"].append(f"base {base}: {comp} {version} (pin) {name}: {cell.text()}")
            if not present:
                log(f"base {base}: {comp}: " + ("no series yet" if per_comp.get(comp) is None else
                                                "the series is empty") + "; nothing to apply")

    # Suites read from results files: one column per (vLLM, LMCache) release pair.
    vl = releases.get("vllm", [config.pins["vllm"]])
    lm = releases.get("lmcache", [config.pins["lmcache"]])
    doc["cells"] = []
    for v in vl:
        for m in lm:
            b = config.pair_base(v, m)
            b = b if b in by_base else None
            doc["cells"].append({"key": cell_key(v, m), "vllm": v, "lmcache": m, "pinned": b is not None,
                                 "pin_of": b})
    keys = [c["key"] for c in doc["cells"]]
    tests_by_patch = {f"{comp}/{name}": info["tests"] for base in doc["probes"] for comp in doc["probes"][base]
                      for name, info in doc["probes"][base][comp].items() if info["tests"]}
    for spec in results:
        if spec.suite not in suites or spec.suite == "apply":
            raise ValueError(f"--results names suite {spec.suite!r}; results can be given for: "
                             f"{', '.join(s for s in suites if s != 'apply')}")
        if cell_key(spec.vllm, spec.lmcache) not in keys:
            raise ValueError(f"--results {spec.suite}@{spec.vllm}/{spec.lmcache}: no such cell in the matrix")
    split = {s: pats for s, pats in config.split.items() if s in suites}
    for suite in suites:
        if suite == "apply":
            continue
        rows: dict[str, dict] = {"stack": {}}
        rows.update({label: {} for label in tests_by_patch})
        for c in doc["cells"]:
            given = [r for r in results if r.suite == suite and cell_key(r.vllm, r.lmcache) == c["key"]]
            # A suite with junit_cases takes its cases from the cell's unit junit when it has no file of its own.
            borrowed = False
            if not given and suite in split:
                given = [r for r in results if r.suite == "unit" and cell_key(r.vllm, r.lmcache) == c["key"]
                         and r.value.lower() not in ("pass", "fail")]
                borrowed = bool(given)
            if not given:
                if c["pinned"] and suite == "gpu":
                    why = f"no GPU run for base {c['pin_of']} (--results gpu=FILE)"
                elif c["pinned"]:
                    why = (f"no results given for base {c['pin_of']} (`make test` writes "
                           f"build/junit/tests-{c['pin_of']}.xml; --results unit=FILE)")
                elif suite == "gpu":
                    why = "no GPU run for this pair"
                else:
                    why = f"no environment for vLLM {c['vllm']} + LMCache {c['lmcache']}"
                    blocked = [f"{comp} {name}" for base in doc["apply"] for comp in ("vllm", "lmcache")
                               if comp in doc["apply"][base] and base == config.base
                               for name, per in doc["apply"][base][comp].items()
                               if per.get(c[comp], {}).get("state") == S_CONFLICTS]
                    if blocked:
                        why += f"; the stack does not apply there (base {config.base}'s series: {len(blocked)} conflicting)"
                for label in rows:
                    rows[label][c["key"]] = asdict(Cell(S_NOT_RUN, why))
                continue
            spec = given[-1]
            if spec.value.lower() in ("pass", "fail"):
                state = S_PASS if spec.value.lower() == "pass" else S_FAIL
                for label in rows:
                    rows[label][c["key"]] = asdict(Cell(state, "reported by the caller"))
            else:
                path = Path(spec.value)
                try:
                    cases = read_junit(path)
                except (OSError, ET.ParseError) as err:
                    for label in rows:
                        rows[label][c["key"]] = asdict(Cell(S_ERROR, f"cannot read {path}: {err}"))
                    doc["problems"].append(f"{suite} {c['key']}: cannot read {path}: {err}")
                    continue
                source = path.name
                if borrowed:
                    cases = [t for t in cases if _matches_case(t, split[suite])]
                    source = f"{path.name}, cases {' '.join(split[suite])}"
                elif suite == "unit" and split:
                    others = [p for pats in split.values() for p in pats]
                    cases = [t for t in cases if not _matches_case(t, others)]
                    source = f"{path.name}, without {' '.join(others)}"
                if not cases:
                    for label in rows:
                        rows[label][c["key"]] = asdict(Cell(S_NOT_RUN, f"no {suite} test case in {source}"))
                    continue
                rows["stack"][c["key"]] = asdict(summarize(cases, source))
                for label, patterns in tests_by_patch.items():
                    mine = [t for t in cases if matches(t, patterns)]
                    rows[label][c["key"]] = asdict(summarize(mine, source) if mine else
                                                   Cell(S_NOT_RUN, f"no test of this patch in {source}"))
            for label in rows:
                st = rows[label][c["key"]]["state"]
                if st in (S_FAIL, S_ERROR):
                    doc["problems"].append(f"{suite} {c['key']} {label}: {rows[label][c['key']]['detail']}")
        doc["results"][suite] = rows
    orphans = orphan_probes(probes_dir, {c: [p for per in by_base.values() for p in (per.get(c) or [])]
                                         for c in COMPONENTS})
    doc["orphan_probes"] = [str(p) for p in orphans]
    for p in orphans:
        log(f"warning: probe {p} names no patch in any base's series (renamed or dropped patch?)")
    doc["seconds"] = round(time.monotonic() - started, 1)
    return doc


def _matches_case(case: TestCase, patterns: list[str]) -> bool:
    """A junit case's classname (tests.env.lmcache.test_x) or file (tests/env/...) matches a pattern
    and no `!pattern` (an exception to the others)."""
    keys = [case.classname, case.file]

    def hit(pats):
        return any(fnmatch.fnmatchcase(k, p) for p in pats for k in keys if k)

    return hit([p for p in patterns if not p.startswith("!")]) and not hit([p[1:] for p in patterns if p.startswith("!")])


def exit_code(doc: dict) -> int:
    return 1 if doc["problems"] else 0
