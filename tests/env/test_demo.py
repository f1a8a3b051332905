"""`kvstack demo` as `make demo` runs it: the venv's `kvstack` script, the Makefile's environment,
the repository as the working directory, the real CPU engines (kvstack and upstream side by side)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvstack.release.pins import load_pin

pytestmark = [pytest.mark.env, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
KVSTACK = Path(sys.executable).parent / "kvstack"  # $(VENV)/bin/kvstack
RESULT = re.compile(r"RESULT ok streaming: upstream_refused=yes kvstack_served_tokens=(\d+) "
                    r"tokens_identical=yes; lmcache: hit_tokens=(\d+) ttft_speedup=([\d.]+)x "
                    r"tokens_identical=yes")


def make_env() -> dict[str, str]:
    """The Makefile's exports: `?=` keeps a value already set, `:=` overrides it."""
    env = dict(os.environ)
    for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                 "PYTHONHASHSEED": "0"}.items():
        env.setdefault(k, v)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("VLLM_LOGGING_LEVEL", None)
    return env


@pytest.fixture(scope="module")
def demo():
    proc = subprocess.run([str(KVSTACK), "demo"], cwd=ROOT, env=make_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(proc.stdout)
    return proc.stdout.rstrip("\n").splitlines()


def test_demo_steps(demo):
    steps = [line for line in demo if re.match(r"\[\d+/\d+\] ", line)]
    assert [s.split("]")[0] + "]" for s in steps] == [f"[{i}/8]" for i in range(1, 9)]
    assert "llama4 at " in steps[0] and "qwen3next at " in steps[0]
    assert "PYTHONHASHSEED=0" in steps[0]
    # upstream is vLLM with kvstack's vLLM patches taken out (an overlay), said so
    assert f"upstream = vLLM {load_pin('vllm').version} as released" in steps[1] and "patches taken out" in steps[1]


def test_upstream_refuses_the_budget_and_kvstack_serves_it(demo):
    steps = [line for line in demo if line.startswith("[")]
    refusal = steps[2]
    assert "refused to start" in refusal
    # upstream's own error, quoted
    m = re.search(r"estimated maximum model length is (\d+)", refusal)
    assert m and "larger than the available KV cache memory" in refusal, refusal
    served = re.search(r"served the (\d+)-token prompt", steps[3])
    assert served and int(served.group(1)) > int(m.group(1)), steps[3]
    assert "identical to kvstack's" in steps[4]


def test_lmcache_hit_with_hybrid_state_and_same_tokens(demo):
    steps = [line for line in demo if line.startswith("[")]
    assert "LMCacheConnectorV1" in steps[5] and "refused to start" in steps[5]
    assert "recompute" in steps[6] and "TTFT" in steps[6]
    assert "first request 0 hit tokens" in steps[7]
    assert re.search(r"hybrid state restored \d+x at \d+ tokens", steps[7]), steps[7]
    assert steps[7].endswith("-> identical")


def test_summary_table_and_result_line(demo):
    table = demo[next(i for i, line in enumerate(demo) if line.startswith("Summary")):]
    rows = [line for line in table if line.startswith(("llama4", "qwen3next", "  greedy"))]
    assert len(rows) == 4, table
    assert "refused to start" in rows[0] and rows[0].rstrip().endswith("ok")
    assert all(r.rstrip().endswith("identical") for r in rows[1::2])
    assert "LMCache refused" in rows[2] and "tokens from LMCache + state" in rows[2]
    assert any(line.startswith("upstream's error, streaming: \"ValueError:") for line in table)
    m = RESULT.fullmatch(demo[-1])
    assert m, demo[-1]
    assert int(m.group(1)) > 0 and int(m.group(2)) > 0
    assert float(m.group(3)) > 1.0  # a hit restores all but the last 8 tokens: well above 1


def test_demo_help():
    proc = subprocess.run([str(KVSTACK), "demo", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0
    assert "--only {streaming,lmcache}" in proc.stdout
    assert "--upstream {overlay,installed}" in proc.stdout
    from kvstack.testbed.tiny_models import MODEL_NAMES

    assert "--simple" in proc.stdout and f"--model {{{','.join(MODEL_NAMES)}}}" in proc.stdout


def test_simple_demo_ends_with_generated_line(tmp_path):
    """The former demo (`kvstack demo --simple`; the image test runs it in a fresh venv)."""
    cmd = [str(KVSTACK), "demo", "--simple", "--cache-dir", str(tmp_path), "--max-tokens", "8"]
    proc = subprocess.run(cmd, cwd=ROOT, env=make_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.rstrip("\n").splitlines()
    assert lines[-1].startswith("generated: ") and len(lines[-1]) > len("generated: ")
    steps = [line for line in lines if line.startswith("[")]
    assert [s[:5] for s in steps] == [f"[{i}/6]" for i in range(1, 7)]
    assert str(tmp_path / "llama") in steps[0]
    assert f"vLLM {load_pin('vllm').version}" in steps[2]
    assert steps[3].rsplit("token ids ", 1)[1].startswith("[0, ")  # BOS first
    assert "generated 8 token ids" in steps[4]


# ------------------------------------------------------------------ the verdicts, without engines

def _fake_results(**changes):
    """What the engine processes of a passing run report, with `changes` per run name."""
    toks, toks2 = [5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]
    base = dict(crashed=False, started=True, wall_s=1.0, overlaid_modules=["vllm.x"],
                streaming_hooks=False)
    refused = dict(base, started=False, error="ValueError: To serve at least one request with the "
                   "model's max seq len (4096), ... the estimated maximum model length is 224. ...")
    res = {
        "streaming-upstream-budget": refused,
        "streaming-kvstack-budget": dict(base, tokens=toks, prompt_tokens=3000, gen_s=0.2,
                                         peak_device_blocks=8, device_blocks=16,
                                         connector_stats={"capacity_tokens": 1000},
                                         streaming_hooks=True),
        "streaming-upstream-reference": dict(base, tokens=toks, device_blocks=131072),
        "lmcache-upstream-connector": dict(refused, error="ValueError: Hybrid KV cache manager ..."),
        "lmcache-recompute": dict(base, tokens=toks2, first_tokens=toks2, repeat_s=[0.1, 0.12]),
        "lmcache-kvstack": dict(base, tokens=toks2, first_tokens=toks2, first_cached=0,
                                repeat_s=[0.01, 0.02], repeat_cached=[3840, 3840],
                                restored=["Request x: restored hybrid state at 3840 token(s)"] * 2,
                                streaming_hooks=True),
    }
    for name, change in changes.items():
        res[name] = dict(res[name], **change)
    return res


def _run_fake(monkeypatch, tmp_path, capsys, **changes):
    from kvstack.testbed import demo, tiny_models

    results = _fake_results(**changes)
    monkeypatch.setattr(tiny_models, "make_model", lambda name, dest: Path(dest))
    monkeypatch.setattr(tiny_models, "is_current", lambda name, dest: True)
    monkeypatch.setattr(demo, "build_upstream_overlay", lambda work: (tmp_path / "ov", "vLLM 0.25.1 as released"))
    monkeypatch.setattr(demo.Runner, "run", lambda self, name, spec, **kw: results[name])
    for k in ("VLLM_LOGGING_LEVEL", "PYTHONHASHSEED", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND",
              "DO_NOT_TRACK", *tiny_models.ENGINE_ENV):
        monkeypatch.setenv(k, "")  # records the value to restore: the demo sets these
        monkeypatch.delenv(k)
    rc = demo.main(["--work-dir", str(tmp_path / "work"), "--cache-dir", str(tmp_path / "models")])
    out = capsys.readouterr().out.rstrip("\n").splitlines()
    return rc, out


def test_verdict_ok(monkeypatch, tmp_path, capsys):
    rc, out = _run_fake(monkeypatch, tmp_path, capsys)
    assert rc == 0
    m = RESULT.fullmatch(out[-1])
    assert m and m.groups() == ("3000", "3840", "10.0"), out[-1]


@pytest.mark.parametrize("changes, why", [
    ({"streaming-upstream-budget": dict(started=True)}, "upstream vLLM unexpectedly started"),
    ({"streaming-upstream-reference": dict(tokens=[1] * 8)}, "streaming: greedy tokens differ"),
    ({"streaming-kvstack-budget": dict(started=False, error="RuntimeError: boom")},
     "kvstack did not serve the prompt: RuntimeError: boom"),
    ({"lmcache-kvstack": dict(repeat_cached=[0, 0])}, "no LMCache hit"),
    ({"lmcache-kvstack": dict(restored=[])}, "no hybrid state was restored"),
    ({"lmcache-kvstack": dict(tokens=[1] * 8)}, "lmcache: greedy tokens differ"),
    ({"lmcache-upstream-connector": dict(started=True)}, "unexpectedly started LMCacheConnectorV1"),
    ({"lmcache-recompute": dict(crashed=True, error="the engine process exited with -9")},
     "the recompute engine did not run"),
], ids=["upstream-starts", "stream-tokens", "stream-fails", "no-hit", "no-state", "lmc-tokens",
        "upstream-lmcache-starts", "recompute-crash"])
def test_verdict_fail(monkeypatch, tmp_path, capsys, changes, why):
    rc, out = _run_fake(monkeypatch, tmp_path, capsys, **changes)
    assert rc == 1
    assert out[-1].startswith("RESULT FAIL ") and why in out[-1], out[-1]
