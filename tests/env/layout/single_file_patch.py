"""Shared by the layout tests of one-file backend patches (triton_attn, flash_attn,
flex_attention): find the patch in the series, get the backend file as it is once the series is
applied up to it (ladder.state_root; the shared venv is never modified), run the worker that
checks it in a subprocess, and check the patch's trailers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

from ladder import check_applies, find_patch, state_root  # noqa: E402


def patched_file(tmp_dir: Path, subject: str, target: str) -> Path:
    """`target` as it is once the series is applied up to this patch (ladder.state_root)."""
    return state_root(tmp_dir, find_patch(subject, target)) / target


def run_worker(args: list[str], env: dict[str, str]) -> dict:
    """Run a worker script (HERE/args[0] + its arguments); its last stdout line is JSON."""
    res = subprocess.run([sys.executable, str(HERE / args[0]), *args[1:]], capture_output=True,
                         text=True, env=env, timeout=900)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0 and lines, f"worker failed ({res.returncode}):\n{res.stderr[-4000:]}"
    return json.loads(lines[-1])


def check_applies_to_sdist_and_site(subject: str, target: str, sdist: Path,
                                    tmp_path: Path) -> None:
    """The same -p1 patch applies to the pristine sdist tree and to the installed package as it
    is before this patch (no earlier patch touches `target`: the pristine file is that too)."""
    patch = find_patch(subject, target)
    check_applies(patch, sdist, tmp_path / "sdist")
    before = state_root(tmp_path / "before", patch, include=False)
    check_applies(patch, before, tmp_path / "site")
    assert (before / target).read_bytes() == (sdist / target).read_bytes()


def check_trailers(subject: str, target: str, *, subject_line: bool = True) -> None:
    """kvstack's From, the subject, the 2/N Upstream-Status and Drop-When, the issue, and only
    `target` touched (no compiled code)."""
    text = find_patch(subject, target).read_text()
    head = text.split("\n---\n", 1)[0]
    assert "From: kvstack <kvstack@localhost>" in head
    if subject_line:
        assert f"Subject: [PATCH] [kvstack] {subject}" in head
    assert ("Upstream-Status: Backport [https://github.com/vllm-project/vllm/pull/44455, "
            "in vLLM 0.26.0]") in head
    assert "Drop-When: the vLLM pin reaches 0.26.0" in head
    assert "Kvstack-Issue: 3" in head
    touched = [line[6:] for line in text.splitlines() if line.startswith("+++ b/")]
    assert touched == [target], f"the patch must touch only {target} (no compiled code)"
