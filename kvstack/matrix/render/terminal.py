"""The terminal table (what ci/run_matrix.py prints)."""

from __future__ import annotations

from kvstack.matrix.render.common import _notes, all_not_run, apply_tables, short, suite_tables
from kvstack.matrix.states import ANSI


def render_terminal(doc: dict, color: bool = False) -> str:
    def paint(state: str, text: str) -> str:
        return f"\033[{ANSI[state]}m{text}\033[0m" if color else text

    lines = []
    for title, cols, rows in apply_tables(doc) + suite_tables(doc):
        summary = all_not_run(rows, doc) if not title.startswith("apply") else None
        if summary:
            lines += [f"== {title.split(':')[0]}: {summary}", ""]
            continue
        lines.append(f"== {title}")
        w0 = max([len(r[0]) for r in rows] + [5])
        widths = [max([len(c), 8] + [len(short(r[1][i])) for r in rows]) for i, c in enumerate(cols)]
        lines.append("  ".join([" " * w0] + [c.ljust(w) for c, w in zip(cols, widths)]).rstrip())
        for label, cells in rows:
            parts = [label.ljust(w0)]
            for cell, w in zip(cells, widths):
                parts.append(paint(cell["state"], short(cell).ljust(w)))
            lines.append("  ".join(parts).rstrip())
        lines.append("")
    notes = _notes(doc)
    if notes:
        lines.append("== details")
        lines += [f"  {n}" for n in notes]
        lines.append("")
    if doc["problems"]:
        lines.append("== problems (exit 1)")
        lines += [f"  {p}" for p in doc["problems"]]
    else:
        lines.append("== the pinned cells are clean")
    return "\n".join(lines)

