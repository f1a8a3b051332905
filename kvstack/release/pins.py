"""The pins: one `pin.env` per upstream component, beside its fetched tree.

Layout (relative to the repository root)::

    vllm/pin.env        the pin (tracked)
    vllm/upstream/      the verified, unpacked sdist (git-ignored)
    patches/vllm/series the patch stack for it
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ("vllm", "lmcache")


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


@dataclass(frozen=True)
class Pin:
    component: str
    values: dict

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
    def tree(self) -> Path:
        """The fetched upstream tree (sdist root: has setup.py, the package, tests/)."""
        return REPO_ROOT / self.component / "upstream"

    @property
    def series_dir(self) -> Path:
        return REPO_ROOT / "patches" / self.component

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key, default)


def load_pin(component: str, root: Path = REPO_ROOT) -> Pin:
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r} (known: {', '.join(COMPONENTS)})")
    return Pin(component, read_env_file(root / component / "pin.env"))
