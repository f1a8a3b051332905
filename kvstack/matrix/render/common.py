"""What every renderer shares: cell labels, the tables, the notes, the picture grid."""

from __future__ import annotations

from dataclasses import asdict

from kvstack.matrix.upstream_status import propose
from kvstack.matrix.states import (COLORS, LABEL, S_APPLIES, S_ERROR, S_FAIL, S_NONE, S_NOT_RUN, S_PASS, S_SKIPPED,
                                   S_UPSTREAM, SHORT, STATES, Cell)


def short(cell: dict) -> str:
    """A cell's label in the picture and the terminal table."""
    if cell["state"] == S_UPSTREAM and cell.get("how"):
        return "upstream (rev)" if cell["how"] == "reverse-applies" else f"upstream ({cell['how']})"
    return SHORT[cell["state"]]


def proposals(doc: dict) -> list:
    """kvstack upstream-status's proposals for the patches of every base in doc (apply suite only):
    each base's series against the releases after that base's pin."""
    out = []
    if "apply" not in doc["suites"]:
        return out
    for base, per_comp in doc["patches"].items():
        for comp, patches in per_comp.items():
            for info in patches:
                per_version = doc["apply"][base].get(comp, {}).get(info["name"], {})
                prop = propose(comp, info["name"], per_version, doc["bases"][base]["pins"][comp],
                               info.get("upstream_status"), info.get("drop_when"))
                prop.base = base
                out.append(prop)
    return out


def pin_mark(doc: dict, comp: str, version: str) -> str:
    """' (pin of base 0.25)' when a base of doc pins this release, else ''."""
    bases = [b for b, info in doc.get("bases", {}).items() if info["pins"].get(comp) == version]
    return f" (pin of base {', '.join(bases)})" if bases else ""


def _release_label(comp: str, version: str, doc: dict) -> str:
    return version + pin_mark(doc, comp, version)


def series_note(doc: dict, base: str, comp: str) -> str:
    if doc.get("series", {}).get(base, {}).get(comp) == "absent":
        return f"no series yet (patches/{base}/{comp}/series)"
    return "no patches in the series"


def apply_tables(doc: dict) -> list[tuple[str, list[str], list[tuple[str, list[dict]]]]]:
    """[(title, column labels, [(row label, [cell dict per column])])] for the apply suite: one table
    per base and component (that base's series x every listed release of the component)."""
    tables = []
    if "apply" not in doc["suites"]:
        return tables
    for base, per_comp in doc["apply"].items():
        for comp, per_patch in per_comp.items():
            versions = [r["version"] for r in doc["releases"][comp]]
            cols = [_release_label(comp, v, doc) for v in versions]
            rows = []
            for name, cells in per_patch.items():
                rows.append((name, [cells.get(v, asdict(Cell(S_NOT_RUN))) for v in versions]))
            if not rows:
                label = "(no series yet)" if doc["series"][base][comp] == "absent" else "(empty series)"
                rows.append((label, [asdict(Cell(S_NONE, series_note(doc, base, comp))) for _ in versions]))
            tables.append((f"apply, base {doc['bases'][base]['label']}: its {LABEL[comp]} series x "
                           f"{LABEL[comp]} releases", cols, rows))
    return tables


def suite_tables(doc: dict):
    tables = []
    cols = [_cell_label(c, doc) for c in doc.get("cells", [])]
    keys = [c["key"] for c in doc.get("cells", [])]
    for suite, rows in doc["results"].items():
        tables.append((f"{suite}: vLLM / LMCache release pairs", cols,
                       [(label, [cells[k] for k in keys]) for label, cells in rows.items()]))
    return tables


def all_not_run(rows, doc: dict | None = None) -> str | None:
    """For a suite table with no results at all: a one-line summary of why (else None)."""
    cells = [(i, c) for _, row in rows for i, c in enumerate(row)]
    if not cells or any(c["state"] != S_NOT_RUN for _, c in cells):
        return None
    meta = (doc or {}).get("cells", [])
    pinned_idx = {i for i, m in enumerate(meta) if m.get("pin_of")} or {0}
    first = rows[0][1] if rows else []
    pinned = "; ".join(dict.fromkeys(first[i]["detail"] for i in sorted(pinned_idx) if i < len(first)))
    others = sorted({c["detail"].split(";")[0].split(" for ")[0] for i, c in cells if i not in pinned_idx})
    return (f"not run in any pair (pinned pairs: {pinned}" + (f"; others: {', '.join(others)}" if others else "")
            + ")")


def _cell_label(c: dict, doc: dict) -> str:
    return f"{c['vllm']}/{c['lmcache']}" + (f" (pin of base {c['pin_of']})" if c.get("pin_of") else "")


def _notes(doc: dict) -> list[str]:
    """One line per cell that has something to say (conflict, offset, upstream, error)."""
    out = []
    for base, per_comp in doc["apply"].items():
        for comp, per_patch in per_comp.items():
            for name, cells in per_patch.items():
                for version, cell in cells.items():
                    if cell["state"] in (S_APPLIES, S_NONE):
                        continue
                    c = Cell(**cell)
                    out.append(f"base {base}: {LABEL[comp]} {version}, {name}: {c.text()}")
    for suite, rows in doc["results"].items():
        for label, cells in rows.items():
            for key, cell in cells.items():
                if cell["state"] in (S_PASS, S_FAIL, S_ERROR, S_SKIPPED) and (
                        label == "stack" or cell["state"] != S_PASS):
                    out.append(f"{suite} {key}, {label}: {Cell(**cell).text()}")
    return out


def grid(doc: dict) -> dict:
    """The picture's grid: releases (vLLM x LMCache pairs) as columns, (base,) patch x suite as rows."""
    cells = doc.get("cells", [])
    rows = []
    for base, per_comp in doc["apply"].items() if "apply" in doc["suites"] else []:
        for comp, per_patch in per_comp.items():
            empty = "(no series yet)" if doc["series"][base][comp] == "absent" else "(empty series)"
            items = list(per_patch.items()) or [(empty, {})]
            for name, per_version in items:
                row = []
                for c in cells:
                    cell = per_version.get(c[comp]) if per_patch else asdict(Cell(S_NONE, series_note(doc, base, comp)))
                    row.append(cell or asdict(Cell(S_NOT_RUN)))
                rows.append({"label": f"{base} {LABEL[comp]}: {name}", "suite": "apply",
                             "cells": [dict(c, short=short(c)) for c in row]})
    for suite, per_label in doc["results"].items():
        for label, per_key in per_label.items():
            if label != "stack":
                comp, _, name = label.partition("/")
                label = f"{LABEL.get(comp, comp)}: {name}"
            rows.append({"label": "whole stack" if label == "stack" else label, "suite": suite,
                         "cells": [dict(per_key[c["key"]], short=short(per_key[c["key"]])) for c in cells]})
    return {
        "title": f"kvstack regression matrix ({doc['generated']})",
        "columns": [{"top": f"vLLM {c['vllm']}", "bottom": f"LMCache {c['lmcache']}",
                     "pin": f"pin of base {c['pin_of']}" if c.get("pin_of") else ""} for c in cells],
        "rows": rows,
        "colors": COLORS,
        "short": SHORT,
        "states": list(STATES),
    }
