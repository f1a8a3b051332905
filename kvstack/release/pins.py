"""The bases and their pins.

A *base* is a pair of upstream releases the whole stack is built, patched and tested on (vLLM +
LMCache, and the torch they were built against). Each base has its own pins and its own series::

    bases/default              the name of the base used when none is named
    bases/<base>/vllm.env      the vLLM pin (tracked)
    bases/<base>/lmcache.env   the LMCache pin (tracked)
    patches/<base>/<component>/series   the patch stack for it
    upstream/<base>/<component>/        the verified, unpacked sdist (git-ignored)

Which base is in effect: the `base=` argument, else `$KVSTACK_BASE`, else `bases/default`.
`base_for_versions` picks the base whose pins match an installed vLLM/LMCache pair.

Where bases/ and patches/ are read from (DATA_ROOT): the checkout (REPO_ROOT: the scripts, an
editable install) or, in an installed kvstack wheel, the package itself, which carries bases/ and
patches/ as package data (kvstack/bases/<base>/*.env, kvstack/patches/<base>/<component>/; see
pyproject.toml), so `kvstack doctor` works without the checkout.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# An installed wheel: bases/ and patches/ are package data of kvstack (the checkout has no kvstack/bases).
PACKAGE_DATA_ROOT = Path(__file__).resolve().parents[1]


def data_root() -> Path:
    """The folder holding bases/ and patches/: the installed package's data when it carries them (a
    wheel), else the checkout (unchanged there: kvstack/bases does not exist in a checkout)."""
    if (PACKAGE_DATA_ROOT / "bases" / "default").is_file():
        return PACKAGE_DATA_ROOT
    return REPO_ROOT


DATA_ROOT = data_root()
COMPONENTS = ("vllm", "lmcache")
BASE_ENV = "KVSTACK_BASE"


def cache_dir() -> Path:
    """Where downloads are kept between fresh clones (sdists, wheels, tools)."""
    base = os.environ.get("KVSTACK_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvstack"
    )
    return Path(base)


def read_env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.isidentifier() or " " in value:
            raise ValueError(f"{path}:{lineno}: expected KEY=VALUE, got {raw!r}")
        values[key] = value
    return values


def _version_key(text: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", text))


def base_names(root: Path = DATA_ROOT) -> list[str]:
    """Every base in bases/, oldest first."""
    found = [p.name for p in (root / "bases").iterdir() if p.is_dir() and (p / "vllm.env").is_file()]
    return sorted(found, key=_version_key)


def default_base(root: Path = DATA_ROOT) -> str:
    """$KVSTACK_BASE when set, else the name in bases/default."""
    name = os.environ.get(BASE_ENV) or (root / "bases" / "default").read_text().strip()
    if name not in base_names(root):
        raise ValueError(f"unknown base {name!r} (from ${BASE_ENV} or bases/default); "
                         f"the bases are: {', '.join(base_names(root))}")
    return name


@dataclass(frozen=True)
class Pin:
    component: str
    values: dict
    base: str
    root: Path = DATA_ROOT

    @property
    def project(self) -> str:
        return self.values["PROJECT"]

    @property
    def version(self) -> str:
        return self.values["VERSION"]

    @property
    def sdist(self) -> str:
        return self.values["SDIST"]

    @property
    def sdist_sha256(self) -> str:
        return self.values["SDIST_SHA256"]

    @property
    def file(self) -> Path:
        return self.root / "bases" / self.base / f"{self.component}.env"

    @property
    def tree(self) -> Path:
        """The fetched upstream tree (sdist root: has setup.py, the package, tests/)."""
        return self.root / "upstream" / self.base / self.component

    @property
    def series_dir(self) -> Path:
        return self.root / "patches" / self.base / self.component

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key, default)


def load_pin(component: str, base: str | None = None, root: Path = DATA_ROOT) -> Pin:
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r} (known: {', '.join(COMPONENTS)})")
    base = base or default_base(root)
    path = root / "bases" / base / f"{component}.env"
    if not path.is_file():
        raise ValueError(f"unknown base {base!r}: no {path} (the bases are: {', '.join(base_names(root))})")
    return Pin(component, read_env_file(path), base, root)


@dataclass(frozen=True)
class Base:
    name: str
    pins: dict

    @property
    def label(self) -> str:
        """'0.32 (vLLM 0.32.0 + LMCache 0.5.6)'."""
        return f"{self.name} (vLLM {self.pins['vllm'].version} + LMCache {self.pins['lmcache'].version})"


def load_base(name: str | None = None, root: Path = DATA_ROOT) -> Base:
    name = name or default_base(root)
    return Base(name, {c: load_pin(c, name, root) for c in COMPONENTS})


def release_of(version: str | None) -> str | None:
    """0.25.1+cpu / 0.25.1.dev3 -> 0.25.1."""
    if version is None:
        return None
    m = re.match(r"\d+(\.\d+)*", version)
    return m.group(0) if m else version


def base_for_versions(versions: dict[str, str | None], root: Path = DATA_ROOT) -> Base | None:
    """The base whose pins equal every given (component -> installed version); None if none does.
    Components given as None (not installed) are not compared."""
    for name in reversed(base_names(root)):
        base = load_base(name, root)
        if all(v is None or release_of(v) == base.pins[c].version for c, v in versions.items()):
            return base
    return None


def bases_summary(root: Path = DATA_ROOT) -> str:
    """'0.25 (vLLM 0.25.1 + LMCache 0.5.3), 0.32 (vLLM 0.32.0 + LMCache 0.5.6)'."""
    return ", ".join(load_base(n, root).label for n in base_names(root))
