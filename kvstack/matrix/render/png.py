"""matrix.png: the grid drawn by matplotlib (in a small venv of its own when this Python lacks it)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from kvstack.matrix.render.common import grid
from kvstack.matrix.states import log
from kvstack.release.pins import cache_dir

PLOT_SCRIPT = r'''
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

g = json.load(open(sys.argv[1]))
out = sys.argv[2]
cols, rows = g["columns"], g["rows"]
ncol, nrow = max(len(cols), 1), max(len(rows), 1)
label_w = max([len(r["label"]) for r in rows] + [10]) * 0.066 + 0.9
cw, rh = 1.2, 0.34
fig_w = label_w + ncol * cw + 0.4
fig_h = 1.85 + nrow * rh + 0.6
fig = plt.figure(figsize=(fig_w, fig_h), dpi=110)
ax = fig.add_axes([0, 0, 1, 1])
ax.set_xlim(0, fig_w)
ax.set_ylim(fig_h, 0)
ax.axis("off")
ax.text(0.2, 0.35, g["title"], fontsize=11, weight="bold", va="center")
top = 1.5
for j, c in enumerate(cols):
    x = label_w + j * cw
    if c.get("pin"):
        ax.add_patch(Rectangle((x + 0.02, top - 0.92), cw - 0.04, 0.2, color="#fff3c4"))
        ax.text(x + cw / 2, top - 0.82, c["pin"], ha="center", va="center", fontsize=6.5, weight="bold")
    ax.text(x + cw / 2, top - 0.52, c["top"], ha="center", va="center", fontsize=7.5)
    ax.text(x + cw / 2, top - 0.25, c["bottom"], ha="center", va="center", fontsize=7)
light = {"applies with offset", "not run", "no patches"}
for i, r in enumerate(rows):
    y = top + i * rh
    ax.text(0.2, y + rh / 2, r["label"], ha="left", va="center", fontsize=7.5, family="monospace")
    ax.text(label_w - 0.1, y + rh / 2, r["suite"], ha="right", va="center", fontsize=7, color="#555")
    for j, cell in enumerate(r["cells"]):
        x = label_w + j * cw
        st = cell["state"]
        ax.add_patch(Rectangle((x + 0.02, y + 0.02), cw - 0.04, rh - 0.04, color=g["colors"][st]))
        ax.text(x + cw / 2, y + rh / 2, cell["short"], ha="center", va="center", fontsize=7,
                color="#222" if st in light else "white")
ly = top + nrow * rh + 0.35
x = 0.2
for st in g["states"]:
    ax.add_patch(Rectangle((x, ly - 0.12), 0.24, 0.24, color=g["colors"][st]))
    ax.text(x + 0.3, ly, st, va="center", fontsize=7)
    x += 0.45 + len(st) * 0.065
fig.savefig(out)
'''


def plot_python() -> str | None:
    """A Python that has matplotlib: this one, or a small venv under cache_dir() (created on first use)."""
    if importlib.util.find_spec("matplotlib") is not None:
        return sys.executable
    venv = cache_dir() / "plot-venv"
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import matplotlib"], capture_output=True).returncode == 0:
        return str(py)
    log(f"installing matplotlib into {venv} (once) for the PNG")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
        subprocess.run([str(py), "-m", "pip", "install", "--quiet", "matplotlib"], check=True,
                       capture_output=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as err:
        log(f"warning: could not install matplotlib ({err}); no PNG, see the HTML")
        return None
    return str(py)


def render_png(doc: dict, out: Path) -> bool:
    py = plot_python()
    if py is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "grid.json"
        script = Path(tmp) / "plot.py"
        spec.write_text(json.dumps(grid(doc)))
        script.write_text(PLOT_SCRIPT)
        proc = subprocess.run([py, str(script), str(spec), str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        log(f"warning: the PNG failed: {proc.stderr.strip()[-500:]}")
        return False
    return True

