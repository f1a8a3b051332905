"""ci/run_matrix.py's command line: run the matrix and write its outputs, or propose a new base."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvstack.matrix.config import load_config
from kvstack.matrix.states import log
from kvstack.matrix.render.html import render_html
from kvstack.matrix.render.json import public_json
from kvstack.matrix.render.markdown import render_markdown, update_report
from kvstack.matrix.render.png import render_png
from kvstack.matrix.render.terminal import render_terminal
from kvstack.matrix.results import parse_result_spec
from kvstack.matrix.run import exit_code, run_matrix
from kvstack.release.patchstack import read_series
from kvstack.release.pins import COMPONENTS, REPO_ROOT, base_names, load_pin


def _component_dirs(values: list[str] | None) -> dict[str, Path]:
    out = {}
    for v in values or []:
        comp, sep, path = v.partition("=")
        if not sep or comp not in COMPONENTS:
            raise SystemExit(f"error: expected COMPONENT=DIR with COMPONENT in {COMPONENTS}, got {v!r}")
        out[comp] = Path(path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ci/run_matrix.py",
        description="Check each base's patch stack against the upstream releases of ci/matrix.toml and report "
        "a table (terminal, Markdown), matrix.json, matrix.html and matrix.png; or propose a new base.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""apply states: applies / applies with offset / conflicts (file, hunk) /
already upstream (reverse-applies, or ci/probes/<component>/<patch>.py says so).
Each base's series (patches/<base>/<component>/series) is checked against every listed release.
Other suites: from --results, else "not run". A results file named tests-<base>.xml (what
`make test` writes) fills the pinned pair of that base; another file without @ fills the
default base's. With [suite.e2e-cpu] junit_cases in ci/matrix.toml, a unit junit is split:
the matching cases are the e2e-cpu cell, the rest the unit cell.

examples:
  ci/run_matrix.py --suites apply                       # the cheap pass (make test)
  ci/run_matrix.py --publish --results unit=build/junit/tests-0.25.xml --results unit=build/junit/tests-0.32.xml
  ci/run_matrix.py --component vllm --release vllm=0.26.0 --base 0.25
  ci/run_matrix.py --propose-base 0.33.0 0.5.6          # a pin bump: check, print the new pin files
  ci/run_matrix.py --propose-base 0.33.0 0.5.6 --write  # ... and write vllm/0.33.env, lmcache/0.33.env + ci/matrix.toml lines

exit codes:
  0  the pinned cells are clean (every base's series applies to its pins, no failed results, no errors);
     with --propose-base: every patch applies or is already upstream in the proposed releases
  1  a patch does not apply to its base's pin, a result failed, a probe or a download errored;
     with --propose-base: a patch conflicts (a rebase is due) or a sdist could not be verified
  2  usage error""",
    )
    parser.add_argument("--root", type=Path, default=REPO_ROOT,
                        help="the kvstack checkout whose bases (pins), series and ci/ are used (default: this one)")
    parser.add_argument("--config", type=Path, help="axes file (default ROOT/ci/matrix.toml)")
    parser.add_argument("--suites", action="append",
                        help="comma-separated suites to include (default: all of the config's)")
    parser.add_argument("--component", action="append", choices=COMPONENTS, help="only these components")
    parser.add_argument("--base", action="append", help="only these bases' series (default: every base)")
    parser.add_argument("--release", action="append", metavar="COMPONENT=VERSION",
                        help="only these releases of a component (the bases' pins are always checked)")
    parser.add_argument("--results", action="append", default=[], metavar="SUITE[@VLLM[/LMCACHE]]=FILE",
                        help="junit xml (or pass/fail) for a suite's cell; without @: the pinned pair of the "
                        "base named by a tests-<base>.xml file name, else of the default base")
    parser.add_argument("--series-dir", action="append", metavar="COMPONENT=DIR",
                        help="use DIR/series instead of patches/<base>/<component>/series (one base only)")
    parser.add_argument("--probes-dir", type=Path, help="default ROOT/ci/probes")
    parser.add_argument("--out", type=Path, help="where REPORT.md, matrix.json/html/png go (default ROOT/build/matrix)")
    parser.add_argument("--publish", action="store_true",
                        help="write into ci/ instead: ci/REPORT.md (between its markers), ci/matrix.*")
    parser.add_argument("--no-png", action="store_true", help="skip the PNG (no matplotlib needed)")
    parser.add_argument("--offline", action="store_true", help="never contact the index; use cached sdists only")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    parser.add_argument("--propose-base", nargs=2, metavar=("VLLM_VERSION", "LMCACHE_VERSION"),
                        help="a pin bump: apply the newest base's series to these releases' sdists and print "
                        "per patch state, Drop-When candidates, ci/matrix.toml lines and the new pin files")
    parser.add_argument("--from-base", help="with --propose-base: whose series (default: the newest base)")
    parser.add_argument("--write", action="store_true",
                        help="with --propose-base: write vllm/<new>.env, lmcache/<new>.env and the ci/matrix.toml lines")
    parser.add_argument("--rerender", type=Path, metavar="MATRIX_JSON",
                        help="run nothing: write REPORT.md's section, matrix.html (and matrix.png) again "
                        "from a matrix.json (with --publish: ci/matrix.json into ci/)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    args.config = args.config or root / "ci" / "matrix.toml"
    args.probes_dir = args.probes_dir or root / "ci" / "probes"
    args.out = args.out or root / "build" / "matrix"
    if (args.write or args.from_base) and not args.propose_base:
        parser.error("--write and --from-base go with --propose-base")
    if args.propose_base:
        return _propose(args, root)
    if args.rerender:
        return _rerender(args, root)

    try:
        config = load_config(args.config, root)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    suites = config.suites
    if args.suites:
        wanted = [s.strip() for v in args.suites for s in v.split(",") if s.strip()]
        bad = [s for s in wanted if s not in config.suites]
        if bad:
            parser.error(f"unknown suite(s) {bad}; the config has {config.suites}")
        suites = [s for s in config.suites if s in wanted]
    releases_filter: dict[str, list[str]] = {}
    for v in args.release or []:
        comp, sep, ver = v.partition("=")
        if not sep or comp not in COMPONENTS:
            parser.error(f"--release expects COMPONENT=VERSION, got {v!r}")
        if ver not in config.releases[comp]:
            parser.error(f"--release {v}: {ver} is not in {args.config} (add it there first)")
        releases_filter.setdefault(comp, []).append(ver)
    bases = args.base or base_names(root)
    unknown = [b for b in bases if b not in config.bases]
    if unknown:
        parser.error(f"unknown base(s) {unknown}; the bases are: {', '.join(config.bases)}")
    series_dirs = _component_dirs(args.series_dir)
    if series_dirs and len(bases) != 1:
        if config.base not in bases:
            parser.error("--series-dir replaces one base's series: name it with --base")
        bases = [config.base]
    series: dict[str, dict] = {}
    for b in bases:
        series[b] = {}
        for c in COMPONENTS:
            d = series_dirs.get(c) or load_pin(c, b, root).series_dir
            series[b][c] = read_series(d) if (d / "series").is_file() else None
    try:
        results = [parse_result_spec(s, config.pins, config.bases) for s in args.results]
        doc = run_matrix(config, suites, series, args.probes_dir, results, args.component, args.offline,
                         releases_filter)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty() and not os.environ.get("NO_COLOR"))
    out = root / "ci" if args.publish else args.out
    out.mkdir(parents=True, exist_ok=True)
    shown = ["python3 ci/run_matrix.py", *(argv if argv is not None else sys.argv[1:])]
    doc["command"] = " ".join(shown)
    doc["commit"] = _commit(root)
    (out / "matrix.json").write_text(public_json(doc))
    update_report(out / "REPORT.md", render_markdown(doc))
    (out / "matrix.html").write_text(render_html(doc), encoding="utf-8")
    written = ["REPORT.md", "matrix.json", "matrix.html"]
    if not args.no_png and render_png(doc, out / "matrix.png"):
        written.append("matrix.png")
    log(f"wrote {', '.join(str(out / w) for w in written)} ({doc['seconds']} s)")
    try:
        print(render_terminal(doc, color), flush=True)
    except BrokenPipeError:  # e.g. piped into head
        sys.stderr.close()
    return exit_code(doc)


def _commit(root: Path) -> str:
    """The checkout's commit (short), "+changes" when its tree differs; "" outside git."""
    import subprocess

    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+changes" if dirty else "")


def _rerender(args, root: Path) -> int:
    """REPORT.md's section and the pictures again from a matrix.json: what CI checks the committed
    ci/REPORT.md against (tests/tooling/test_matrix.py)."""
    import json

    doc = json.loads(args.rerender.read_text())
    out = root / "ci" if args.publish else args.out
    out.mkdir(parents=True, exist_ok=True)
    update_report(out / "REPORT.md", render_markdown(doc))
    (out / "matrix.html").write_text(render_html(doc), encoding="utf-8")
    written = ["REPORT.md", "matrix.html"]
    if not args.no_png and render_png(doc, out / "matrix.png"):
        written.append("matrix.png")
    log(f"wrote {', '.join(str(out / w) for w in written)} from {args.rerender}")
    return 0


def _propose(args, root: Path) -> int:
    from kvstack.matrix import propose_base as P

    vllm, lmcache = args.propose_base
    try:
        report = P.propose_base(vllm, lmcache, args.from_base, root, args.config, args.probes_dir, args.offline)
        written = P.write(report, root, args.config) if args.write else None
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(P.render(report, written), flush=True)
    return P.exit_code(report)


if __name__ == "__main__":
    sys.exit(main())
