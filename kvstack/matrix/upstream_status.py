"""`kvstack upstream-status`: propose each patch's Upstream-Status / Drop-When from the matrix.

Reads the apply suite of the regression matrix (ci/matrix.json, written by
`ci/run_matrix.py --publish`; re-run automatically when it is missing or older than a
patch) and, per patch, compares what its header claims with what the releases show:

- upstream since X (X and every later checked release have it, by reverse-apply or probe):
  proposes ``Upstream-Status: Backport [<refs>, upstream in vLLM X]`` and
  ``Drop-When: vllm >= X`` ("drop when the pin moves to X or later"). A header that already
  names a version Y with  previous-checked < Y <= X  agrees (Y may be an unchecked release).
- in no checked release: keeps the status (``Pending`` if there is none) and proposes
  ``Drop-When: upstream has it (not in vLLM <= newest)``; a header that claims a checked
  release has it is flagged CHECK (a missing or wrong probe, or a wrong claim).
- upstream in some release but not in a later one: flagged CHECK (reverted upstream, or a
  probe that is too loose).
It also names the first release where a not-yet-upstream patch conflicts (a rebase is due).

Exit codes: 0 done (with --check: every header agrees), 1 with --check: some header should
change or needs a look, 2 usage / no matrix.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvstack.matrix.apply_suite import diff_sha256
from kvstack.matrix.config import load_config
from kvstack.matrix.run import run_matrix
from kvstack.matrix.states import LABEL, S_APPLIES, S_CONFLICTS, S_OFFSET, S_UPSTREAM, SCHEMA, version_key
from kvstack.release.patchstack import read_series
from kvstack.release.pins import COMPONENTS, REPO_ROOT, default_base, load_pin

DEFAULT_MATRIX = REPO_ROOT / "ci" / "matrix.json"
VERSION_RE = re.compile(r"(?<![\w.#])v?(\d+\.\d+(?:\.\d+)?)(?![\w.])")
REF_RE = re.compile(r"https?://\S+?(?=[\],;\s]|$)|(?:[\w.-]+/[\w.-]+)?#\d+")
DROP_RE = re.compile(r"\b(vllm|lmcache)\s*>=\s*v?(\d+(?:\.\d+)*)", re.I)


@dataclass
class Proposal:
    component: str
    patch: str
    states: list[tuple[str, str]]  # (version, state with how) ascending, pin first
    current_status: str | None
    current_drop: str | None
    status: str | None
    drop: str | None
    verdict: str  # ok / update / CHECK / stale
    reasons: list[str] = field(default_factory=list)
    base: str = ""  # the base whose series holds the patch

    @property
    def changes(self) -> bool:
        return self.verdict == "update"


def _claimed_versions(text: str | None) -> list[str]:
    return VERSION_RE.findall(text or "")


def _within(version: str, low: str | None, high: str) -> bool:
    """low < version <= high (low None: anything up to high)."""
    k = version_key(version)
    return (low is None or k > version_key(low)) and k <= version_key(high)


def propose(component: str, patch: str, per_version: dict[str, dict], pin: str,
            current_status: str | None, current_drop: str | None) -> Proposal:
    label = LABEL[component]
    versions = sorted(per_version, key=version_key)
    raw = [(v, per_version[v]["state"]) for v in versions]
    states = [(v, s + (f" ({per_version[v]['how']})" if per_version[v].get("how") else "")) for v, s in raw]
    later = [(v, s) for v, s in raw if version_key(v) > version_key(pin)]
    reasons: list[str] = []
    status, drop, verdict = current_status, current_drop, "ok"
    refs = REF_RE.findall(current_status or "")
    upstream_at = [v for v, s in later if s == S_UPSTREAM]

    if not later:
        reasons.append("no release newer than the pin is in the matrix")
        return Proposal(component, patch, states, current_status, current_drop, status, drop, verdict, reasons)

    since = None
    if later[-1][1] == S_UPSTREAM:
        since = later[-1][0]
        for v, s in reversed(later):
            if s != S_UPSTREAM:
                break
            since = v
    checked = [v for v, _ in states]
    prev = checked[checked.index(since) - 1] if since else None

    if since:
        how = per_version[since].get("how") or "?"
        reasons.append(f"upstream in {label} {since} and every later checked release ({how}); "
                       f"previous checked release {prev} does not have it")
        claims = _claimed_versions(current_status)
        status_ok = bool(current_status) and current_status.split()[0].rstrip(":").lower() in (
            "backport", "accepted") and any(_within(c, prev, since) for c in claims)
        if not status_ok:
            inner = ", ".join(dict.fromkeys(refs))
            status = f"Backport [{inner + ', ' if inner else ''}upstream in {label} {since}]"
        drop_claims = [(c.lower(), v) for c, v in DROP_RE.findall(current_drop or "")]
        drop_ok = any(c == component and _within(v, prev, since) for c, v in drop_claims)
        if not drop_ok:
            drop = f"{component} >= {since}"
        verdict = "ok" if status_ok and drop_ok else "update"
    elif upstream_at:
        verdict = "CHECK"
        not_at = [v for v, s in later if s != S_UPSTREAM and version_key(v) > version_key(upstream_at[0])]
        reasons.append(f"upstream in {label} {', '.join(upstream_at)} but not in {', '.join(not_at)}: "
                       "reverted upstream, or a probe that is too loose")
    else:
        newest = later[-1][0]
        claims = [c for c in _claimed_versions(current_status) if version_key(c) > version_key(pin)]
        checked_claims = [c for c in claims if version_key(c) <= version_key(newest)]
        is_backport = bool(current_status) and current_status.split()[0].rstrip(":").lower() in ("backport", "accepted")
        if is_backport and checked_claims:
            verdict = "CHECK"
            reasons.append(f"Upstream-Status claims {label} {', '.join(checked_claims)}, but no checked release "
                           f"up to {newest} has the change (add a probe in ci/probes/ if upstream did it differently)")
        if not current_status:
            status = f"Pending [{', '.join(dict.fromkeys(refs))}]" if refs else "Pending"
            verdict = "update" if verdict == "ok" else verdict
        inappropriate = bool(current_status) and current_status.lower().startswith("inappropriate")
        wanted_drop = "never (kvstack-only change)" if inappropriate else f"upstream has it (not in {label} <= {newest})"
        drop_claims = [(c.lower(), v) for c, v in DROP_RE.findall(current_drop or "")]
        wrong = [v for c, v in drop_claims if c == component and version_key(v) <= version_key(newest)]
        if wrong:
            verdict = "CHECK" if verdict == "CHECK" else "update"
            reasons.append(f"Drop-When says {component} >= {wrong[0]}, but the change is in no checked "
                           f"release up to {newest}")
            drop = wanted_drop
        elif not current_drop or (current_drop.startswith("upstream has it (not in") and not inappropriate):
            drop = wanted_drop
            if current_drop != drop and verdict == "ok":
                verdict = "update"
        reasons.append(f"in no checked {label} release up to {newest}")
    conflicts = [v for v, s in later if s == S_CONFLICTS and (since is None or version_key(v) < version_key(since))]
    if conflicts:
        detail = per_version[conflicts[0]].get("detail", "")
        reasons.append(f"conflicts from {label} {conflicts[0]} on ({detail}): a rebase is due before the pin moves there")
    pin_state = per_version.get(pin, {}).get("state")
    if pin_state not in (S_APPLIES, S_OFFSET, None):
        verdict = "CHECK"
        reasons.append(f"on the pin {pin} it is '{pin_state}', not applies")
    return Proposal(component, patch, states, current_status, current_drop, status, drop, verdict, reasons)


# --------------------------------------------------------------------------- patch headers


def split_message(text: str) -> tuple[str, str]:
    """(commit message part, rest starting at the '---' line) of a git format-patch file."""
    m = re.search(r"^---$", text, re.M)
    if not m:
        m = re.search(r"^diff --git ", text, re.M)
    if not m:
        return text, ""
    return text[:m.start()], text[m.start():]


def read_fields(patch: Path) -> dict[str, str | None]:
    head, _ = split_message(patch.read_text(errors="replace"))
    out = {}
    for key in ("Upstream-Status", "Drop-When"):
        m = re.search(rf"^{key}:[ \t]*(.*)$", head, re.M)
        out[key] = m.group(1).strip() if m else None
    return out


def set_fields(text: str, values: dict[str, str]) -> str:
    """Replace or add header lines (Upstream-Status, Drop-When) in a patch's commit message."""
    head, rest = split_message(text)
    for key, value in values.items():
        line = f"{key}: {value}"
        pat = re.compile(rf"^{key}:[ \t]*.*$", re.M)
        if pat.search(head):
            head = pat.sub(lambda _m: line, head, count=1)
            continue
        anchor = re.search(r"^Upstream-Status:.*$", head, re.M) if key == "Drop-When" else None
        if anchor:
            head = head[:anchor.end()] + "\n" + line + head[anchor.end():]
            continue
        body = head.rstrip("\n")
        last = body.splitlines()[-1] if body else ""
        sep = "\n" if re.match(r"^[A-Z][\w-]*: ", last) else "\n\n"
        head = body + sep + line + "\n" + ("\n" if rest.startswith("diff") else "")
    return head + rest


# --------------------------------------------------------------------------- CLI


def load_matrix(path: Path) -> dict | None:
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def stale_patches(doc: dict, series: dict[str, list[Path]], base: str) -> list[str]:
    stale = []
    if doc.get("schema") != SCHEMA or base not in doc.get("patches", {}):
        return [f"(the matrix result has no base {base}, or an older schema)"]
    for comp, patches in series.items():
        known = {p["name"]: p.get("diff_sha256") for p in doc["patches"][base].get(comp, [])}
        for p in patches:
            if known.get(p.name) != diff_sha256(p):
                stale.append(f"{comp}/{p.name}")
        gone = set(known) - {p.name for p in patches}
        stale += [f"{comp}/{n} (no longer in the series)" for n in sorted(gone)]
    if "apply" not in doc.get("suites", []):
        stale.append("(the matrix has no apply suite)")
    return stale


def fresh_matrix(config_path: Path, series: dict[str, list[Path]], probes_dir: Path, offline: bool,
                 base: str | None = None) -> dict:
    config = load_config(config_path, base=base)
    return run_matrix(config, ["apply"], series, probes_dir, [], offline=offline)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvstack upstream-status",
        description="Propose each patch's Upstream-Status / Drop-When header from the regression matrix "
        "(which releases already have the change).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""The matrix result is ci/matrix.json (ci/run_matrix.py --publish). When it is missing,
or a patch changed since, the apply suite is run first (downloads sdists once, cached).

exit codes:
  0  done (with --check: every header agrees with the matrix)
  1  with --check: a header should change (update) or needs a look (CHECK)
  2  usage error, or no matrix result and --no-run""",
    )
    parser.add_argument("--matrix", type=Path, default=DEFAULT_MATRIX, help="matrix.json (default ci/matrix.json)")
    parser.add_argument("--run", action="store_true", help="run the apply suite now instead of reading --matrix")
    parser.add_argument("--no-run", action="store_true", help="never run the suite; fail if the result is stale")
    parser.add_argument("--offline", action="store_true", help="with a run: use cached sdists only")
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "ci" / "matrix.toml")
    parser.add_argument("--probes-dir", type=Path, default=REPO_ROOT / "ci" / "probes")
    parser.add_argument("--series-dir", action="append", metavar="COMPONENT=DIR")
    parser.add_argument("--component", action="append", choices=COMPONENTS)
    parser.add_argument("--base", help="whose series (default: $KVSTACK_BASE, else vllm/default)")
    parser.add_argument("--write", action="store_true", help="write the proposed lines into the patch files")
    parser.add_argument("--check", action="store_true", help="exit 1 when a header should change or needs a look")
    parser.add_argument("--json", action="store_true", help="print the proposals as JSON")
    args = parser.parse_args(argv)
    if args.run and args.no_run:
        parser.error("--run and --no-run exclude each other")

    dirs = {}
    for v in args.series_dir or []:
        comp, sep, d = v.partition("=")
        if not sep or comp not in COMPONENTS:
            parser.error(f"--series-dir expects COMPONENT=DIR, got {v!r}")
        dirs[comp] = Path(d)
    components = args.component or list(COMPONENTS)
    doc = None if args.run else load_matrix(args.matrix)
    # The base: --base, else the one the matrix result names as default, else this checkout's default.
    base = args.base or (doc or {}).get("base") or default_base()
    series = {c: read_series(dirs.get(c) or load_pin(c, base).series_dir) for c in components}
    stale = stale_patches(doc, series, base) if doc else ["(no result)"]
    if args.run or stale:
        if args.no_run:
            print(f"error: {args.matrix} is missing or stale for: {', '.join(stale)}; "
                  "run ci/run_matrix.py --publish (or drop --no-run)", file=sys.stderr)
            return 2
        if not args.run:
            print(f"[upstream-status] {args.matrix.name} is missing or stale for: {', '.join(stale)}; "
                  "running the apply suite", file=sys.stderr)
        doc = fresh_matrix(args.config, series, args.probes_dir, args.offline, base)

    proposals: list[Proposal] = []
    for comp in components:
        pin = doc["bases"][base]["pins"][comp]
        for patch in series[comp]:
            fields = read_fields(patch)
            per_version = doc["apply"][base].get(comp, {}).get(patch.name, {})
            prop = propose(comp, patch.name, per_version, pin, fields["Upstream-Status"], fields["Drop-When"])
            prop.base = base
            proposals.append(prop)

    if args.json:
        print(json.dumps([asdict(p) for p in proposals], indent=1))
    else:
        if not proposals:
            print("the series are empty: nothing to propose")
        for p in proposals:
            print(f"{p.component}/{p.patch}: {p.verdict}")
            print("  matrix: " + " | ".join(f"{v} {s}" for v, s in p.states))
            for r in p.reasons:
                print(f"  - {r}")
            for key, cur, new in (("Upstream-Status", p.current_status, p.status), ("Drop-When", p.current_drop, p.drop)):
                if cur == new:
                    print(f"  {key}: {cur if cur is not None else '(none)'}  (keep)")
                else:
                    print(f"  {key}: {cur if cur is not None else '(none)'}")
                    print(f"  {' ' * len(key)}  -> {new}")
    if args.write:
        for p in proposals:
            if not p.changes:
                continue
            path = (dirs.get(p.component) or load_pin(p.component, base).series_dir) / p.patch
            values = {}
            if p.status and p.status != p.current_status:
                values["Upstream-Status"] = p.status
            if p.drop and p.drop != p.current_drop:
                values["Drop-When"] = p.drop
            path.write_text(set_fields(path.read_text(), values))
            print(f"wrote {path}")
    if args.check and any(p.verdict in ("update", "CHECK") for p in proposals):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
