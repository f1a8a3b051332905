"""kvstack's regression matrix: every base's patch stack x upstream releases x suites.

Entry points: ``python3 ci/run_matrix.py`` (``cli.main``; system python3 >= 3.11, no vLLM for the
apply suite) and ``kvstack upstream-status`` (``upstream_status.main``). The modules, in the order
data flows through them (each imports only modules above it; no import cycle)::

    states.py          cell states, colours, marks, the Cell record, SCHEMA
                       in: nothing               out: the vocabulary every other module uses
    config.py          ci/matrix.toml + the bases' pins
                       in: matrix.toml, vllm/<base>.env, lmcache/<base>.env
                       out: Config (releases, every base's pins, digests, junit_cases splits)
    sdists.py          release sdists: download once, verify sha256, unpack once
                       in: Config, cache_dir()/sdists (the index only for a sdist not cached)
                       out: (sdist, sha256, how verified), a pristine tree in cache_dir()/trees
    probes.py          ci/probes/<component>/<patch>.py: "upstream in another form" + TESTS
                       in: probes dir, patch files      out: Probe, orphan probes
    apply_suite.py     one series on one release tree (git apply --check, no fuzz)
                       in: tree, patches, probes  out: {patch: Cell} applies/offset/conflicts/upstream
    results.py         unit / e2e-cpu / gpu results
                       in: --results SUITE[@V/L]=FILE; tests-<base>.xml names its base
                       out: ResultSpec, TestCase, summarized Cells
    run.py             one run of the matrix
                       in: Config, {base: {component: series}}, probes, results
                       out: the matrix document (dict, schema 2; layout in run.py's docstring)
    upstream_status.py `kvstack upstream-status`: Upstream-Status / Drop-When proposals
                       in: the document (or a fresh apply run)  out: Proposals, header edits
    render/common.py   tables, notes, the picture's grid    in: document  out: rows and columns
    render/terminal.py the printed table                    in: document  out: text
    render/markdown.py REPORT.md between its markers        in: document  out: Markdown
    render/html.py     matrix.html                          in: document  out: HTML
    render/png.py      matrix.png (matplotlib, own venv)    in: document  out: PNG file
    render/json.py     matrix.json (local paths dropped)    in: document  out: JSON text
    propose_base.py    a pin bump: `--propose-base VLLM LMCACHE`
                       in: two versions, the newest base's series, sdist cache
                       out: per-patch states, Drop-When candidates, matrix.toml lines, new pin files
    cli.py             ci/run_matrix.py's arguments; writes the outputs   in: argv  out: files, exit code

What each suite means:

apply
    For every base, every release of a component and every patch of that base's series, in
    series order, on a pristine copy of the release's sdist (kvstack.release.patchstack.plan_series,
    no fuzz): ``applies`` / ``applies with offset`` / ``conflicts`` (file and hunk named) /
    ``already upstream`` (the patch reverse-applies, or its probe says so). A base's series must
    apply to its own pins (else exit 1); on other releases any state is information.
    A probe is ``ci/probes/<component>/<patch file name without .patch>.py`` defining
    ``probe(tree: Path) -> bool`` (True: the change is already upstream in that tree) and/or
    ``TESTS``: fnmatch patterns over junit ``classname`` values, which give the patch its own rows
    in the other suites. An absent ``patches/<base>/<component>/series`` is "no series yet".
unit, e2e-cpu, gpu
    Read from results passed to the runner; a cell without results is ``not run``. A file named
    ``tests-<base>.xml`` (what ``make test`` writes per base) fills that base's pinned pair; a
    suite with ``junit_cases`` in ci/matrix.toml (e2e-cpu: tests/env/ except upstream's own suite,
    ``!pattern`` being an exception) takes the matching cases of a ``unit`` file, and unit keeps the rest.

Exit codes of cli.main(): 0 the pinned cells are clean, 1 otherwise, 2 usage.
"""

from kvstack.matrix.apply_suite import apply_release, conflict_detail, diff_sha256, patch_info  # noqa: F401
from kvstack.matrix.config import DEFAULT_CONFIG, Config, load_config  # noqa: F401
from kvstack.matrix.probes import Probe, load_probe, orphan_probes, probe_path  # noqa: F401
from kvstack.matrix.render.common import apply_tables, grid, proposals, short, suite_tables  # noqa: F401
from kvstack.matrix.render.html import render_html  # noqa: F401
from kvstack.matrix.render.json import public_json  # noqa: F401
from kvstack.matrix.render.markdown import REPORT_BEGIN, REPORT_END, render_markdown, update_report  # noqa: F401
from kvstack.matrix.render.png import render_png  # noqa: F401
from kvstack.matrix.render.terminal import render_terminal  # noqa: F401
from kvstack.matrix.results import ResultSpec, TestCase, cell_key, parse_result_spec, read_junit  # noqa: F401
from kvstack.matrix.run import exit_code, run_matrix  # noqa: F401
from kvstack.matrix.sdists import TREE_STAMP, SourceError, _sdist_names, release_tree, resolve_sdist  # noqa: F401
from kvstack.matrix.states import *  # noqa: F401,F403
from kvstack.release.fetch import sha256_of  # noqa: F401


def main(argv=None):
    from kvstack.matrix.cli import main as _main
    return _main(argv)
