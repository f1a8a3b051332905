"""ci/matrix.toml and the bases: the axes of the matrix (releases, suites, digests, result splits)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kvstack.matrix.states import log, version_key
from kvstack.release.pins import COMPONENTS, REPO_ROOT, base_names, default_base, load_pin, pin_relpath

DEFAULT_CONFIG = REPO_ROOT / "ci" / "matrix.toml"


@dataclass
class Config:
    releases: dict[str, list[str]]  # component -> versions, ascending, every base's pin included
    pins: dict[str, str]  # component -> version: the pins of `base` (the default base)
    suites: list[str]
    descriptions: dict[str, str] = field(default_factory=dict)
    sha256: dict[str, str] = field(default_factory=dict)  # ci/matrix.toml [sha256]
    pin_sha256: dict[str, str] = field(default_factory=dict)  # component -> SDIST_SHA256 of `base`
    projects: dict[str, str] = field(default_factory=dict)
    path: str = ""
    base: str = ""  # the base whose pins are `pins`
    bases: dict[str, dict[str, str]] = field(default_factory=dict)  # base -> component -> pinned version
    base_sha256: dict[str, tuple[str, str]] = field(default_factory=dict)  # "comp version" -> (sha256, pin file)
    split: dict[str, list[str]] = field(default_factory=dict)  # suite -> junit patterns taken from `unit` files

    def pin_of(self, component: str, version: str) -> list[str]:
        """The bases that pin this release of the component."""
        return [b for b, pins in self.bases.items() if pins.get(component) == version]

    def pair_base(self, vllm: str, lmcache: str) -> str | None:
        """The base whose pins are exactly this (vLLM, LMCache) pair."""
        for b, pins in self.bases.items():
            if pins.get("vllm") == vllm and pins.get("lmcache") == lmcache:
                return b
        return None


def _load_toml(path: Path) -> dict:
    try:
        import tomllib  # Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise SystemExit(f"error: reading {path} needs Python >= 3.11 (tomllib) or the tomli package")
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def load_config(path: Path = DEFAULT_CONFIG, repo_root: Path = REPO_ROOT, base: str | None = None) -> Config:
    """The axes of path, with every base of repo_root (vllm/<base>.env + lmcache/<base>.env: their pins
    are always checked). `pins` are those of `base` (default: $KVSTACK_BASE, else vllm/default)."""
    data = _load_toml(path)
    suites = list(data.get("suites", ["apply"]))
    unknown = [s for s in suites if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", s)]
    if unknown:
        raise ValueError(f"{path}: bad suite names {unknown}")
    base = base or default_base(repo_root)
    all_bases = base_names(repo_root)
    bases: dict[str, dict[str, str]] = {}
    base_sha: dict[str, tuple[str, str]] = {}
    for b in all_bases:
        bases[b] = {}
        for comp in COMPONENTS:
            pin = load_pin(comp, b, repo_root)
            bases[b][comp] = pin.version
            base_sha.setdefault(f"{comp} {pin.version}", (pin.sdist_sha256, pin_relpath(comp, b)))
    releases, pins, pin_sha, projects = {}, {}, {}, {}
    for comp in COMPONENTS:
        pin = load_pin(comp, base, repo_root)
        pins[comp] = pin.version
        pin_sha[comp] = pin.sdist_sha256
        projects[comp] = pin.project
        listed = [str(v) for v in data.get(comp, {}).get("releases", [])]
        for v in listed:
            if not re.fullmatch(r"\d+(\.\d+)*([a-z0-9.+-]*)", v):
                raise ValueError(f"{path}: [{comp}] releases: {v!r} is not a version")
        for b in all_bases:
            if bases[b][comp] not in listed:
                log(f"{comp}: the pin {bases[b][comp]} of base {b} is not listed in {path.name}; checking it anyway")
                listed.append(bases[b][comp])
        releases[comp] = sorted(dict.fromkeys(listed), key=version_key)
    suite_tables = data.get("suite", {})
    descriptions = {k: str(v.get("description", "")) for k, v in suite_tables.items()}
    split = {k: [str(p) for p in v.get("junit_cases", [])] for k, v in suite_tables.items() if v.get("junit_cases")}
    for k in split:
        if k not in suites or k in ("apply", "unit"):
            raise ValueError(f"{path}: [suite.{k}] junit_cases: only a suite other than apply and unit, "
                             f"listed in `suites`, can take its cases from the unit results")
    return Config(releases, pins, suites, descriptions, dict(data.get("sha256", {})), pin_sha, projects,
                  str(path), base, bases, base_sha, split)
