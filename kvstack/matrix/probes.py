"""ci/probes/<component>/<patch>.py: "already upstream in another form" checks and TESTS patterns."""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvstack.release.pins import COMPONENTS


def probe_path(probes_dir: Path, component: str, patch: Path) -> Path:
    stem = patch.name[:-len(".patch")] if patch.name.endswith(".patch") else patch.name
    return probes_dir / component / f"{stem}.py"


@dataclass
class Probe:
    path: Path
    func: object = None  # probe(tree) -> bool, or None when the file only declares TESTS
    tests: list[str] = field(default_factory=list)
    error: str = ""


def load_probe(probes_dir: Path, component: str, patch: Path) -> Probe | None:
    path = probe_path(probes_dir, component, patch)
    if not path.is_file():
        return None
    name = "kvstack_probe_" + re.sub(r"\W", "_", f"{component}_{path.stem}")
    if str(probes_dir) not in sys.path:  # probes share helpers: `from _probelib import ...`
        sys.path.insert(0, str(probes_dir))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as err:
        return Probe(path, error=f"{type(err).__name__}: {err}")
    func = getattr(module, "probe", None)
    tests = [str(t) for t in getattr(module, "TESTS", [])]
    if func is not None and not callable(func):
        return Probe(path, tests=tests, error="probe is not callable")
    return Probe(path, func, tests)


def orphan_probes(probes_dir: Path, series: dict[str, list[Path]]) -> list[Path]:
    """Probe files naming no patch of the series (a renamed or dropped patch)."""
    orphans = []
    for comp in COMPONENTS:
        wanted = {probe_path(probes_dir, comp, p) for p in series.get(comp, [])}
        folder = probes_dir / comp
        if folder.is_dir():
            orphans += [p for p in sorted(folder.glob("*.py")) if p not in wanted and not p.name.startswith("_")]
    return orphans
