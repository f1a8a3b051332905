"""The bases and their pins.

A *base* is a pair of upstream releases the whole stack is built, patched and tested on (vLLM +
LMCache, and the torch they were built against). Each component has its own folder at the root of
the checkout, holding that component's pin for every base and its fetched sources::

    vllm/default               the name of the base used when none is named
    vllm/<base>.env            the vLLM pin of a base, torch's included (tracked); a base is named
                               after its vLLM release (0.32 = vLLM 0.32.x), so vllm/*.env lists the bases
    lmcache/<base>.env         the LMCache pin of that base (tracked)
    <component>/src/<base>/    the verified, unpacked sdist (git-ignored; patched in place with the
                               base's series by `make apply`, hence one tree per base, not per release)
    patches/<base>/<component>/series   the patch stack for it

Neither vllm/ nor lmcache/ has an __init__.py: for Python they are at most namespace-package
candidates, so `import vllm` / `import lmcache` from the checkout's root load the installed packages
(a regular package anywhere on sys.path wins over a namespace portion; tests/tooling/test_layout.py).

Which base is in effect: the `base=` argument, else `$KVSTACK_BASE`, else `vllm/default`.
`base_for_versions` picks the base whose pins match an installed vLLM/LMCache pair.

Where the pins and patches/ are read from (DATA_ROOT): the checkout (REPO_ROOT: the scripts, an
editable install) or, in an installed kvstack wheel, the package itself, which carries them as package
data (kvstack/vllm/default, kvstack/<component>/<base>.env, kvstack/patches/<base>/<component>/; see
pyproject.toml), so `kvstack doctor` works without the checkout.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# An installed wheel: the pins and patches/ are package data of kvstack (kvstack/vllm/default,
# kvstack/<component>/<base>.env, kvstack/patches/); the checkout has no kvstack/vllm.
PACKAGE_DATA_ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("vllm", "lmcache")
BASE_ENV = "KVSTACK_BASE"
# The file naming the default base, relative to the data root. A base is named after its vLLM
# release, and vllm/*.env lists the bases, so the default's name sits beside them.
DEFAULT_FILE = Path("vllm") / "default"
# The fetched, unpacked sdists: <component>/src/<base>/ (git-ignored).
SOURCES = "src"


def data_root() -> Path:
    """The folder holding vllm/, lmcache/ (the pins) and patches/: the installed package's data when it
    carries them (a wheel), else the checkout (kvstack/vllm does not exist in a checkout)."""
    if (PACKAGE_DATA_ROOT / DEFAULT_FILE).is_file():
        return PACKAGE_DATA_ROOT
    return REPO_ROOT


DATA_ROOT = data_root()


def pin_relpath(component: str, base: str) -> str:
    """'vllm/0.32.env': one component's pin of one base, relative to the data root."""
    return f"{component}/{base}.env"


def pin_path(component: str, base: str, root: Path = DATA_ROOT) -> Path:
    """<root>/<component>/<base>.env."""
    return root / pin_relpath(component, base)


def tree_path(component: str, base: str, root: Path = DATA_ROOT) -> Path:
    """<component>/src/<base>/: the base's fetched, unpacked sdist of the component (git-ignored)."""
    return root / component / SOURCES / base


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
    """Every base (a vllm/<base>.env), oldest first."""
    folder = root / "vllm"
    found = [p.name[:-len(".env")] for p in folder.glob("*.env") if p.is_file()] if folder.is_dir() else []
    return sorted(found, key=_version_key)


def file_default_base(root: Path = DATA_ROOT) -> str:
    """The name in vllm/default (not $KVSTACK_BASE)."""
    return (root / DEFAULT_FILE).read_text().strip()


def default_base(root: Path = DATA_ROOT) -> str:
    """$KVSTACK_BASE when set, else the name in vllm/default."""
    name = os.environ.get(BASE_ENV) or file_default_base(root)
    if name not in base_names(root):
        raise ValueError(f"unknown base {name!r} (from ${BASE_ENV} or {DEFAULT_FILE}); "
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
        return pin_path(self.component, self.base, self.root)

    @property
    def tree(self) -> Path:
        """The fetched upstream tree (sdist root: has setup.py, the package, tests/)."""
        return tree_path(self.component, self.base, self.root)

    @property
    def series_dir(self) -> Path:
        return self.root / "patches" / self.base / self.component

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key, default)


def load_pin(component: str, base: str | None = None, root: Path = DATA_ROOT) -> Pin:
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r} (known: {', '.join(COMPONENTS)})")
    base = base or default_base(root)
    path = pin_path(component, base, root)
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
