"""The apply suite: each patch of a series, in order, on a pristine release tree."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from kvstack.matrix.probes import Probe
from kvstack.matrix.states import S_APPLIES, S_CONFLICTS, S_ERROR, S_OFFSET, S_UPSTREAM, Cell
from kvstack.release.fetch import sha256_of
from kvstack.release.patchstack import ALREADY, APPLIES, OFFSET, patch_headers, plan_series


def _hunks(patch: Path) -> dict[str, list[int]]:
    """file -> old-side start line of each hunk, in order."""
    hunks: dict[str, list[int]] = {}
    current = None
    for line in patch.read_text(errors="replace").splitlines():
        m = re.match(r"^diff --git a/(\S+) b/(\S+)$", line)
        if m:
            current = m.group(1)
            hunks.setdefault(current, [])
            continue
        m = re.match(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@", line)
        if m and current is not None:
            hunks[current].append(int(m.group(1)))
    return hunks


def conflict_detail(patch: Path, detail: str) -> str:
    """git's 'patch failed: FILE:LINE' plus which hunk of the patch that is."""
    hunks = _hunks(patch)

    def name(m: re.Match) -> str:
        path, line = m.group(1), int(m.group(2))
        starts = hunks.get(path, [])
        if line in starts:
            return f"{path} hunk #{starts.index(line) + 1} (@@ -{line})"
        return f"{path}:{line}"

    detail = re.sub(r"while searching for:;?\s*", "", detail)
    out = re.sub(r"patch failed: (\S+?):(\d+)", name, detail)
    # git repeats the file in "<file>: patch does not apply"; keep it short.
    out = re.sub(r"; (\S+): patch does not apply", "", out)
    return out


def apply_release(component: str, tree: Path, patches: list[Path], probes: dict[Path, Probe],
                  pinned: bool) -> dict[str, Cell]:
    cells: dict[str, Cell] = {}
    if not patches:
        return cells
    plan = plan_series(component, patches, tree)
    try:
        for res in plan.results:
            probe = probes.get(res.patch)
            said, probe_err = None, ""
            if probe is not None and probe.error:
                probe_err = f"probe {probe.path.name} failed to load: {probe.error}"
            elif probe is not None and probe.func is not None:
                try:
                    said = bool(probe.func(tree))
                except Exception as err:  # a probe bug must not hide the textual result
                    probe_err = f"probe raised {type(err).__name__}: {err}"
            if res.state == ALREADY:
                note = "probe says not upstream" if said is False else ""
                cell = Cell(S_UPSTREAM, "", "reverse-applies", note)
            elif said:
                textual = ("the patch still applies textually" if res.state in (APPLIES, OFFSET) else
                           f"the patch conflicts textually: {conflict_detail(res.patch, res.detail)}")
                cell = Cell(S_UPSTREAM, "", "probe", textual)
            elif res.state == APPLIES:
                cell = Cell(S_APPLIES)
            elif res.state == OFFSET:
                cell = Cell(S_OFFSET, res.detail)
            else:
                cell = Cell(S_CONFLICTS, conflict_detail(res.patch, res.detail))
            if probe_err:
                cell = Cell(S_ERROR, probe_err, note=cell.text())
            elif pinned and cell.state == S_UPSTREAM:
                cell = Cell(S_ERROR, f"already upstream in the pin ({cell.how}): the patch or its probe is wrong",
                            note=cell.note)
            cells[res.patch.name] = cell
    finally:
        plan.cleanup()
    return cells


def diff_sha256(patch: Path) -> str:
    """sha256 of the diff part only (from the first 'diff --git'): header edits do not change it."""
    data = patch.read_bytes()
    at = data.find(b"\ndiff --git ")
    return hashlib.sha256(data[at + 1:] if at >= 0 else data).hexdigest()


def patch_info(patch: Path) -> dict:
    msg = patch_headers(patch)
    body = msg.get_payload() if not msg.is_multipart() else ""
    head = body.split("\n---\n", 1)[0] if isinstance(body, str) else ""
    fields = {}
    for key in ("Upstream-Status", "Drop-When"):
        m = re.search(rf"^{key}:[ \t]*(.*)$", head, re.M)
        fields[key] = m.group(1).strip() if m else None
    subject = " ".join(str(msg.get("Subject", "")).split())
    return {"name": patch.name, "sha256": sha256_of(patch), "diff_sha256": diff_sha256(patch), "subject": subject,
            "upstream_status": fields["Upstream-Status"], "drop_when": fields["Drop-When"]}

