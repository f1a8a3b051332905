"""A pin bump in one command: check a proposed new base (vLLM X + LMCache Y) against the newest base's series.

    python3 ci/run_matrix.py --propose-base 0.33.0 0.5.6 [--from-base 0.32] [--write] [--offline]

in:  two release versions; the newest base (or --from-base) with its pins and series
     (patches/<base>/<component>/series; absent = "no series yet"); ci/probes/; ci/matrix.toml's
     [sha256]; the sdist cache (cache_dir()/sdists; the index is contacted only for a sdist not cached).
out: a report: per patch applies / applies with offset / conflicts (file, hunk) / already upstream
     (reverse-applies or probe); the Drop-When candidates (patches already upstream, with their
     Drop-When trailer); the lines to add to ci/matrix.toml (releases, [sha256]); the suggested
     vllm/<new>.env and lmcache/<new>.env (VERSION, SDIST, SDIST_SHA256 checked; wheel and torch lines
     copied from a base that pins the same release, else left as TODO comments).
     Nothing in the repository changes unless write=True: then vllm/<new>.env, lmcache/<new>.env and
     the ci/matrix.toml lines are written (vllm/default, the series and the probes are left alone).
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

from kvstack.matrix.apply_suite import apply_release, patch_info
from kvstack.matrix.config import Config, load_config
from kvstack.matrix.probes import load_probe
from kvstack.matrix.sdists import SourceError, release_tree, resolve_sdist
from kvstack.matrix.states import LABEL, S_APPLIES, S_CONFLICTS, S_ERROR, S_OFFSET, S_UPSTREAM
from kvstack.release.patchstack import read_series
from kvstack.release.pins import COMPONENTS, REPO_ROOT, base_names, load_pin, pin_path, pin_relpath, read_env_file

CHECKED_KEYS = ("PROJECT", "VERSION", "SDIST", "SDIST_SHA256")


def new_base_name(vllm_version: str) -> str:
    """Bases are named by vLLM's major.minor: 0.33.0 -> 0.33."""
    parts = re.findall(r"\d+", vllm_version)
    return ".".join(parts[:2]) if len(parts) >= 2 else vllm_version


def _pin_text(config: Config, root: Path, comp: str, version: str, sdist: str, digest: str,
              from_base: str, new_base: str, versions: dict[str, str]) -> str:
    """The suggested <comp>/<new>.env."""
    known = [b for b in config.bases if config.bases[b][comp] == version]
    template = load_pin(comp, known[-1] if known else from_base, root)
    values = dict(template.values)
    old = template.version
    pair = f"vLLM {versions['vllm']} + LMCache {versions['lmcache']}"
    lines = [f"# The {LABEL[comp]} pin of base {new_base} ({pair}). Read by scripts/*.sh, "
             "kvstack/release/pins.py and the Dockerfile.",
             "# Proposed by `ci/run_matrix.py --propose-base`: VERSION, SDIST and SDIST_SHA256 are checked"
             + (f"; the other lines are base {known[-1]}'s, which pins the same release." if known else
                "; the TODO lines are a guess from base " + from_base + ": check each against the index."),
             f"PROJECT={values['PROJECT']}", f"VERSION={version}", f"SDIST={sdist}", f"SDIST_SHA256={digest}"]
    for key, value in values.items():
        if key in CHECKED_KEYS:
            continue
        if known:
            lines.append(f"{key}={value}")
        elif key.endswith("_PROJECT"):
            lines.append(f"{key}={value}")
        elif key.endswith("_SHA256"):
            lines.append(f"# TODO {key}=<sha256 of the file above, from the index>")
        else:
            guess = value.replace(old, version) if old in value else value
            lines.append(f"# TODO {key}={guess}" + ("" if old in value else "  (copied: not version-named; check it)"))
    return "\n".join(lines) + "\n"


def propose_base(vllm: str, lmcache: str, from_base: str | None = None, root: Path = REPO_ROOT,
                 config_path: Path | None = None, probes_dir: Path | None = None, offline: bool = False) -> dict:
    """The proposal as a dict (see the module docstring). Raises ValueError on a usage error."""
    names = base_names(root)
    from_base = from_base or names[-1]
    if from_base not in names:
        raise ValueError(f"unknown base {from_base!r} (the bases are: {', '.join(names)})")
    config_path = config_path or root / "ci" / "matrix.toml"
    probes_dir = probes_dir or root / "ci" / "probes"
    config = load_config(config_path, root, base=from_base)
    versions = {"vllm": vllm, "lmcache": lmcache}
    for comp, v in versions.items():
        if not re.fullmatch(r"\d+(\.\d+)*([a-z0-9.+-]*)", v):
            raise ValueError(f"{comp} {v!r} is not a version")
    new = new_base_name(vllm)
    out: dict = {"from_base": from_base, "from_label": load_label(config, from_base), "new_base": new,
                 "new_base_exists": new in names, "versions": versions, "sdists": {}, "series": {},
                 "patches": {}, "drop_candidates": [], "conflicts": [], "toml_lines": [], "pin_files": {},
                 "problems": []}
    for comp, version in versions.items():
        try:
            sdist, digest, how = resolve_sdist(config, comp, version, offline)
            tree = release_tree(config, comp, version, offline)[0]
        except SourceError as err:
            out["problems"].append(str(err))
            continue
        out["sdists"][comp] = {"file": sdist.name, "sha256": digest, "verified_by": how}
        if version not in config.releases[comp]:
            out["toml_lines"].append(f'[{comp}] releases: add "{version}"')
        if sdist.name not in config.sha256 and not config.pin_of(comp, version):
            out["toml_lines"].append(f'[sha256]: "{sdist.name}" = "{digest}"')
        out["pin_files"][comp] = _pin_text(config, root, comp, version, sdist.name, digest, from_base, new, versions)
        series_dir = load_pin(comp, from_base, root).series_dir
        if not (series_dir / "series").is_file():
            out["series"][comp] = "absent"
            out["patches"][comp] = []
            continue
        out["series"][comp] = "present"
        patches = [p for p in read_series(series_dir) if p.is_file()]
        probes = {p: pr for p in patches if (pr := load_probe(probes_dir, comp, p)) is not None}
        cells = apply_release(comp, tree, patches, probes, pinned=False)
        rows = []
        for p in patches:
            info = patch_info(p)
            cell = cells.get(p.name)
            row = {"name": p.name, **asdict(cell), "drop_when": info["drop_when"],
                   "upstream_status": info["upstream_status"]}
            rows.append(row)
            if cell.state == S_UPSTREAM:
                out["drop_candidates"].append({"component": comp, **row})
            elif cell.state == S_CONFLICTS:
                out["conflicts"].append({"component": comp, **row})
            elif cell.state == S_ERROR:
                out["problems"].append(f"{comp} {p.name}: {cell.detail}")
        out["patches"][comp] = rows
    return out


def load_label(config: Config, base: str) -> str:
    pins = config.bases[base]
    return f"{base} (vLLM {pins['vllm']} + LMCache {pins['lmcache']})"


def exit_code(report: dict) -> int:
    """0: every patch applies or is already upstream; 1: a conflict (a rebase is due) or an error."""
    return 1 if report["conflicts"] or report["problems"] else 0


STATE_WORD = {S_APPLIES: "applies", S_OFFSET: "applies with offset", S_CONFLICTS: "CONFLICTS",
              S_UPSTREAM: "already upstream", S_ERROR: "ERROR"}


def render(report: dict, written: list[str] | None = None) -> str:
    v = report["versions"]
    lines = [f"propose base {report['new_base']}: vLLM {v['vllm']} + LMCache {v['lmcache']}, "
             f"checked against the series of base {report['from_label']}", ""]
    if report["new_base_exists"]:
        lines += [f"note: base {report['new_base']} already exists (--write will not overwrite its pins)", ""]
    lines.append("sdists (verified):")
    for comp, s in report["sdists"].items():
        lines.append(f"  {s['file']}  sha256 {s['sha256']}  ({s['verified_by']})")
    lines.append("")
    for comp in COMPONENTS:
        if comp not in report["series"]:
            continue
        lines.append(f"{LABEL[comp]} series of base {report['from_base']} on {LABEL[comp]} {v[comp]}:")
        if report["series"][comp] == "absent":
            lines.append(f"  no series yet (patches/{report['from_base']}/{comp}/series)")
        elif not report["patches"][comp]:
            lines.append("  the series is empty")
        for row in report["patches"][comp]:
            state = STATE_WORD.get(row["state"], row["state"])
            extra = f" ({row['how']})" if row.get("how") else ""
            detail = f": {row['detail']}" if row.get("detail") else ""
            lines.append(f"  {row['name']}  {state}{extra}{detail}")
        lines.append("")
    lines.append("Drop-When candidates (already upstream in the proposed release: leave them out of the new "
                 "base's series):")
    for row in report["drop_candidates"] or []:
        lines.append(f"  {row['component']}/{row['name']}  ({row['how']})  Drop-When: {row['drop_when'] or '(none)'}")
    if not report["drop_candidates"]:
        lines.append("  none")
    lines.append("")
    if report["conflicts"]:
        lines.append(f"To rebase ({len(report['conflicts'])} conflicting: git apply --3way or edit, then "
                     "scripts/export_patches.sh into the new base's series):")
        lines += [f"  {r['component']}/{r['name']}: {r['detail']}" for r in report["conflicts"]]
        lines.append("")
    lines.append("ci/matrix.toml:")
    lines += [f"  {t}" for t in report["toml_lines"]] or ["  nothing to add (both releases and digests are there)"]
    lines.append("")
    for comp, text in report["pin_files"].items():
        lines.append(f"{pin_relpath(comp, report['new_base'])} (suggested):")
        lines += [f"  {t}" for t in text.splitlines()]
        lines.append("")
    if report["problems"]:
        lines.append("problems:")
        lines += [f"  {p}" for p in report["problems"]]
        lines.append("")
    if written:
        lines.append("wrote: " + ", ".join(written))
    else:
        lines.append("nothing written (add --write to write vllm/<new>.env, lmcache/<new>.env and the ci/matrix.toml lines)")
    return "\n".join(lines)


def _add_to_toml(text: str, comp: str | None, line: str, table: str) -> str:
    """Insert `line` at the end of [comp]'s releases list, or of the [sha256] table."""
    if table == "releases":
        m = re.search(rf"^\[{re.escape(comp)}\][^\[]*?^releases\s*=\s*\[(?P<body>[^\]]*)\]", text, re.S | re.M)
        if not m:
            raise ValueError(f"no [{comp}] releases = [ ... ] list in ci/matrix.toml")
        body = m.group("body")
        if "\n" in body:  # one release a line
            new_body = body.rstrip(" ") + f"  {line},\n"
        else:
            new_body = (body.rstrip().rstrip(",") + ", " if body.strip() else "") + line
        return text[:m.start("body")] + new_body + text[m.end("body"):]
    m = re.search(r"^\[sha256\]\s*\n(?:(?!^\[).*\n?)*", text, re.M)
    if not m:
        return text.rstrip("\n") + f"\n\n[sha256]\n{line}\n"
    block = m.group(0).rstrip("\n") + "\n"
    return text[:m.start()] + block + line + "\n" + text[m.end():].lstrip("\n")


def write(report: dict, root: Path = REPO_ROOT, config_path: Path | None = None) -> list[str]:
    """Write the suggested pin files and the ci/matrix.toml lines; returns what was written."""
    config_path = config_path or root / "ci" / "matrix.toml"
    new_files = {comp: pin_path(comp, report["new_base"], root) for comp in COMPONENTS}
    for path in new_files.values():
        if path.exists():
            raise ValueError(f"{path} already exists; not overwriting it")
    if set(report["pin_files"]) != set(COMPONENTS):
        raise ValueError("not every sdist was verified; nothing written")
    text = config_path.read_text()
    before = text
    for comp, s in report["sdists"].items():
        version = report["versions"][comp]
        if f'[{comp}] releases: add "{version}"' in report["toml_lines"]:
            text = _add_to_toml(text, comp, f'"{version}"', "releases")
        line = f'"{s["file"]}" = "{s["sha256"]}"'
        if f"[sha256]: {line}" in report["toml_lines"]:
            text = _add_to_toml(text, None, line, "sha256")
    written = []
    for comp, pin_text in report["pin_files"].items():
        path = new_files[comp]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(pin_text)
        read_env_file(path)  # the suggestion is a valid KEY=VALUE file
        written.append(str(path.relative_to(root)))
    if text != before:
        config_path.write_text(text)
        written.append(str(config_path.relative_to(root)) if config_path.is_relative_to(root) else str(config_path))
    return written
