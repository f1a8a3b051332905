"""Results of the other suites (unit, e2e-cpu, gpu): junit xml or pass/fail, per release pair."""

from __future__ import annotations

import fnmatch
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from kvstack.matrix.states import S_ERROR, S_FAIL, S_PASS, S_SKIPPED, Cell


@dataclass
class TestCase:
    classname: str
    name: str
    file: str
    outcome: str  # passed / failed / skipped


def read_junit(path: Path) -> list[TestCase]:
    root = ET.parse(path).getroot()
    cases = []
    for tc in root.iter("testcase"):
        tags = {child.tag for child in tc}
        outcome = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        cases.append(TestCase(tc.get("classname", ""), tc.get("name", ""), tc.get("file", ""), outcome))
    return cases


def summarize(cases: list[TestCase], source: str) -> Cell:
    if not cases:
        return Cell(S_ERROR, f"no test cases in {source}")
    n = {o: sum(c.outcome == o for c in cases) for o in ("passed", "failed", "skipped")}
    counts = f"{n['passed']} passed, {n['failed']} failed" + (f", {n['skipped']} skipped" if n["skipped"] else "")
    if n["failed"]:
        first = [f"{c.classname}::{c.name}" for c in cases if c.outcome == "failed"][:3]
        return Cell(S_FAIL, f"{counts} ({source}); first: {', '.join(first)}")
    if not n["passed"]:  # every test skipped: nothing was shown to work
        return Cell(S_SKIPPED, f"{counts} ({source}): none ran")
    return Cell(S_PASS, f"{counts} ({source})")


def matches(case: TestCase, patterns: list[str]) -> bool:
    keys = [case.classname, f"{case.classname}.{case.name}", case.file]
    return any(fnmatch.fnmatchcase(k, p) for p in patterns for k in keys if k)


@dataclass
class ResultSpec:
    suite: str
    vllm: str
    lmcache: str
    value: str  # a file path, or pass / fail
    base: str | None = None  # the base whose pinned pair this is (from the file name), if any


RESULTS_FILE_RE = re.compile(r"^tests-(?P<base>[\w.-]+)\.xml$")


def base_of_file(value: str, bases: dict[str, dict[str, str]]) -> str | None:
    """`make test` writes build/junit/tests-<base>.xml: the base a results file ran on, by its name."""
    m = RESULTS_FILE_RE.match(Path(value).name)
    return m.group("base") if m and m.group("base") in bases else None


def parse_result_spec(spec: str, pins: dict[str, str], bases: dict[str, dict[str, str]] | None = None) -> ResultSpec:
    """SUITE[@VLLM[/LMCACHE]]=FILE|pass|fail. Without @: the pinned pair of the base named by the file
    (tests-<base>.xml, what `make test` writes), else `pins` (the default base's)."""
    where, sep, value = spec.partition("=")
    if not sep or not value:
        raise ValueError(f"--results {spec!r}: expected SUITE[@VLLM[/LMCACHE]]=FILE|pass|fail")
    suite, at, cell = where.partition("@")
    vllm, _, lmc = cell.partition("/")
    base = base_of_file(value, bases or {})
    if not at and base is not None:
        return ResultSpec(suite, bases[base]["vllm"], bases[base]["lmcache"], value, base)
    return ResultSpec(suite, vllm or pins["vllm"], lmc or pins["lmcache"], value)


def cell_key(vllm: str, lmcache: str) -> str:
    return f"{vllm}/{lmcache}"



def merge_junit(out: Path, paths: list[Path]) -> int:
    """Write the test suites of the junit files `paths` (those that exist) into one file `out`, as
    `make test` does with its parallel and serial passes; returns the number of test cases."""
    merged = ET.Element("testsuites")
    for path in paths:
        if not Path(path).is_file():
            continue
        root = ET.parse(path).getroot()
        merged.extend([root] if root.tag == "testsuite" else list(root))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(merged).write(out, encoding="utf-8", xml_declaration=True)
    return sum(1 for _ in merged.iter("testcase"))

