"""The parallel pass's order: test modules longest first (pytest-xdist's `--dist loadfile`).

pytest-xdist hands each worker one test module at a time, in the order of the modules' test counts,
so the modules of one or two long tests (the own install, the image builds, the benches' smoke runs)
come last, where one of them can keep a worker busy after the other has nothing left (replayed on a
warm run of base 0.32 the two orders differ by about 10 s of a 1,550 s pass; a new long module could
cost minutes). Longest-processing-time-first needs each module's time: `tests/module_seconds.json`
holds them per base, from a run's junit (`python tests/longest_first.py build/junit/parallel-*.xml` writes it;
a module it does not know counts as `UNKNOWN_BASE_S` plus `UNKNOWN_PER_TEST_S` per test;
`KVSTACK_MODULE_SECONDS` names another file). The order changes when a module runs, never what runs
or how.

tests/conftest.py installs the scheduler (`pytest_xdist_make_scheduler`) when `--dist loadfile` is
in effect.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SECONDS_FILE = Path(__file__).resolve().parent / "module_seconds.json"
UNKNOWN_BASE_S = 30.0
UNKNOWN_PER_TEST_S = 1.0


def load_seconds(base: str | None, path: Path = SECONDS_FILE) -> dict[str, float]:
    """{module path: seconds} for `base`, the other bases' figures where it has none."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    merged: dict[str, float] = {}
    for name, modules in table.items():
        if name != base:
            merged.update(modules)
    merged.update(table.get(base or "", {}))
    return merged


def expected_seconds(module: str, n_tests: int, seconds: dict[str, float]) -> float:
    if module in seconds:
        return seconds[module]
    return UNKNOWN_BASE_S + UNKNOWN_PER_TEST_S * n_tests


def order(units: dict[str, int], seconds: dict[str, float]) -> list[str]:
    """Module paths longest first ({module: number of tests} in; ties in the given order)."""
    return sorted(units, key=lambda m: -expected_seconds(m, units[m], seconds))


def make_scheduler(config, log):
    """A LoadFileScheduling that hands out the longest expected module left."""
    from xdist.scheduler import LoadFileScheduling

    seconds = load_seconds(os.environ.get("KVSTACK_BASE"),
                           Path(os.environ.get("KVSTACK_MODULE_SECONDS") or SECONDS_FILE))

    class LongestFirstFileScheduling(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:
            if self.workqueue:
                units = {scope: len(unit) for scope, unit in self.workqueue.items()}
                self.workqueue.move_to_end(order(units, seconds)[0], last=False)
            super()._assign_work_unit(node)

    return LongestFirstFileScheduling(config, log)


def module_of(classname: str, repo: Path = REPO) -> str | None:
    """A junit classname ('tests.env.test_x' or 'tests.env.test_x.TestY') -> 'tests/env/test_x.py'."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        candidate = "/".join(parts[:end]) + ".py"
        if (repo / candidate).is_file():
            return candidate
    return None


def seconds_from_junit(path: Path, repo: Path = REPO) -> dict[str, float]:
    """{module: summed test time} of one junit file (setup and teardown included, as pytest writes)."""
    totals: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = module_of(case.get("classname", ""), repo)
        if module is not None:
            totals[module] = totals.get(module, 0.0) + float(case.get("time") or 0.0)
    return totals


def main(argv: list[str]) -> int:
    """Write module_seconds.json from parallel-<base>.xml files (the base from the file's name)."""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python tests/longest_first.py build/junit/parallel-<base>.xml ...\n"
              "Writes tests/module_seconds.json: each base's modules and their summed test time "
              "(the bases a file is not given for keep their figures).")
        return 0 if argv else 2
    try:
        table = json.loads(SECONDS_FILE.read_text())
    except (OSError, ValueError):
        table = {}
    for arg in argv:
        path = Path(arg)
        base = path.stem.split("-", 1)[-1]
        totals = seconds_from_junit(path)
        table[base] = {m: round(s, 1) for m, s in sorted(totals.items(), key=lambda kv: -kv[1])}
        print(f"{base}: {len(totals)} modules, {sum(totals.values()):.0f} s in all, "
              f"longest {next(iter(table[base]), '-')}")
    SECONDS_FILE.write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
