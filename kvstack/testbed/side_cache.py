"""A side's results reused while nothing it read has changed (the family table's stock side).

The family table's stock side (stock vLLM + LMCache, kvstack's vLLM series taken out again in an
overlay) gives the same results until one of its inputs changes, and running it costs minutes of CI
per base. Its results are kept in ``$KVSTACK_CACHE/family-table/`` (default ``~/.cache/kvstack``)
under a digest of the inputs known before the run, together with the digest of every file of this
repository its runner processes imported (each runner reports them as it exits). A later run
reuses them only when both still match: like a build cache's manifest, any edit of a module the
stock runner ran, of the installed packages, of the overlay or of the tiny models runs it again.

The inputs known before the run (``fixed_inputs``): the cells, the base, the host's CPU (model name
and flags: vLLM's CPU kernels differ with AMX and AVX-512), the cores the engines get, every
installed distribution's name and version, the files of the installed ``vllm`` and ``lmcache``
packages, of the stock overlay and of the tiny models, and the environment variables of vLLM,
LMCache, OpenMP and torch. ``KVSTACK_STOCK_CACHE=0`` runs the side regardless (and stores what it
got).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

from kvstack.release.fetch import sha256_of as file_digest

REPO = Path(__file__).resolve().parents[2]
ENV_PREFIXES = ("VLLM_", "LMCACHE_", "OMP_", "KMP_", "MKL_", "TORCH_", "KVSTACK_")
# per-run values, not inputs: server ports and temp paths (the overlay's content is an input); where
# vLLM keeps its caches and when the garbage collector runs (kvstack.testbed.gc_heap) change no token
ENV_IGNORED = ("KVSTACK_FAMILY_MP_PORTS", "KVSTACK_OVERLAY", "KVSTACK_STOCK_CACHE", "VLLM_CACHE_ROOT",
               "KVSTACK_FREEZE_GC_HEAP")
SWITCH = "KVSTACK_STOCK_CACHE"
VERSION = 1  # bump when what a cached entry holds changes


def cache_dir() -> Path:
    from kvstack.release.pins import cache_dir as kvstack_cache

    return kvstack_cache() / "family-table"


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def tree_digest(root: Path) -> str:
    """Every file under `root` (compiled bytecode left out) by relative path and content."""
    h = hashlib.sha256()
    if root.is_file():
        return file_digest(root)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        h.update(f"{path.relative_to(root)}\0{file_digest(path)}\n".encode())
    return h.hexdigest()


def host_cpu() -> str:
    """The CPU model and its flags (the first processor of /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = " ".join(sorted(fields.get("flags", "").split()))
    return f"{fields.get('model name', '?')} | {flags}"


def distributions() -> list[str]:
    """The distributions installed in this interpreter's site-packages (not whatever sys.path
    holds at the moment: an import of setuptools adds its vendored packages to it)."""
    import sysconfig
    from importlib import metadata

    paths = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    return sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions(path=paths)
                   if d.metadata["Name"]})


def fixed_inputs(*, what: str, cells: Iterable, trees: dict[str, Path], extra: dict | None = None) -> dict:
    """The inputs known before the run, as a dict (its digest is the cache key)."""
    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith(ENV_PREFIXES) and k not in ENV_IGNORED}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"version": VERSION, "what": what, "cells": [list(c) for c in cells],
            "cpu": host_cpu(), "cores": cores, "env": env, "distributions": distributions(),
            "trees": {name: tree_digest(path) for name, path in sorted(trees.items())},
            **(extra or {})}


def key_of(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def source_digests(files: Iterable[str]) -> dict[str, str | None]:
    """Files of this repository (paths relative to it) by content; None for one that is gone."""
    out = {}
    for rel in sorted(set(files)):
        path = REPO / rel
        out[rel] = file_digest(path) if path.is_file() else None
    return out


def imported_sources() -> list[str]:
    """The files of this repository the current process imported (relative paths): its own
    modules, not the venvs or fetched trees inside the checkout (the installed packages are
    inputs of their own)."""
    import sys

    found = set()
    for mod in list(sys.modules.values()):
        path = getattr(mod, "__file__", None)
        if not path or not os.path.isabs(path) or not path.endswith(".py"):
            continue
        p = Path(path).resolve()
        if p.is_relative_to(REPO):
            rel = p.relative_to(REPO)
            if not rel.parts[0].startswith(".") and rel.parts[0] not in ("build", "vllm", "lmcache"):
                found.add(str(rel))
    return sorted(found)


def entry_path(key: str) -> Path:
    return cache_dir() / f"{key[:24]}.json"


def load(key: str) -> tuple[list[dict], dict] | None:
    """(results, entry) of a cached run whose recorded sources are all unchanged, else None."""
    path = entry_path(key)
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if entry.get("key") != key or not isinstance(entry.get("sources"), dict) or not entry["sources"]:
        return None
    if source_digests(entry["sources"]) != entry["sources"]:
        return None
    return entry["results"], entry


def store(key: str, inputs: dict, results: list[dict], sources: Iterable[str], *,
          keep: int = 8) -> Path:
    """Record a run; the newest `keep` entries stay."""
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    entry = {"key": key, "inputs": inputs, "sources": source_digests(sources), "results": results,
             "made": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    path = entry_path(key)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entry, indent=1) + "\n")
    tmp.replace(path)
    entries = sorted(d.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[keep:]:
        old.unlink(missing_ok=True)
    return path
