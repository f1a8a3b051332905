"""`kvstack demo` as a user runs it: a subprocess of the venv's Python, the real CPU engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.env

ROOT = Path(__file__).resolve().parents[2]


def test_demo_prints_steps_and_ends_with_generated_line(tmp_path):
    env = dict(os.environ)
    env.pop("VLLM_LOGGING_LEVEL", None)
    cmd = [sys.executable, "-m", "kvstack.cli", "demo", "--cache-dir", str(tmp_path), "--max-tokens", "8"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.rstrip("\n").splitlines()
    assert lines[-1].startswith("generated: ") and len(lines[-1]) > len("generated: ")
    steps = [line for line in lines if line.startswith("[")]
    assert [s[:5] for s in steps] == [f"[{i}/6]" for i in range(1, 7)]
    assert str(tmp_path / "llama") in steps[0]
    assert "VLLM_CPU_KVCACHE_SPACE=" in steps[1]
    assert "vLLM 0.25.1" in steps[2]
    prompt_ids = steps[3].rsplit("token ids ", 1)[1]
    assert prompt_ids.startswith("[0, ")  # BOS first
    assert "generated 8 token ids" in steps[4]
    assert (tmp_path / "llama" / "model.safetensors").is_file()


def test_demo_help():
    proc = subprocess.run([sys.executable, "-m", "kvstack.cli", "demo", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "--model {llama,llama4,qwen3next}" in proc.stdout
