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
RESULT = re.compile(
    r"RESULT ok streaming: upstream_refused=yes kvstack_served_tokens=(?P<served>\d+) tokens_identical=yes; "
    r"align: (?:vllm_cached_tokens=(?P<vllm_cached>\d+) lmcache_cached_tokens=(?P<lmc_cached>\d+) "
    r"ttft_vs_vllm_cache=(?P<align_ratio>[\d.]+)x same_prefix_ttft_vs_vllm_cache=(?P<same_prefix_ratio>[\d.]+)x "
    r"tokens_identical=yes zeroed_state_tokens_differ=yes|not_available base=(?P<no_align_base>[\d.]+)); "
    r"cross_process: hit_tokens=(?P<hit>\d+) ttft_speedup=(?P<speedup>[\d.]+)x tokens_identical=yes "
    r"removed_files_hit_tokens=0 zeroed_state_tokens_differ=yes")


def _align_here() -> bool:
    """Whether kvstack's LMCache runs next to vLLM's align-mode prefix cache on this base (0.32: yes;
    0.25: LMCache 0.5.3's adapter refuses align mode, and the demo says so)."""
    from kvstack.testbed.demo import align_unavailable

    return align_unavailable() is None


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
    assert [s.split("]")[0] + "]" for s in steps] == [f"[{i}/9]" for i in range(1, 10)]
    assert "llama4 at " in steps[0] and "qwen3next at " in steps[0]
    assert "long-memory copy at " in steps[0]
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


def test_lmcache_next_to_vllm_cache_and_in_a_new_process(demo):
    steps = [line for line in demo if line.startswith("[")]
    assert "LMCacheConnectorV1" in steps[5] and "refused to start" in steps[5]
    # upstream's best: recompute (its prefix cache reset: nothing cached) and, on 0.32, its own cache
    assert "recomputed" in steps[6] and "(prefix cache reset before each: 0 tokens cached)" in steps[6]
    assert "first request of P 0 hit tokens" in steps[7] and "identical to upstream's" in steps[7]
    if _align_here():
        assert "mamba_cache_mode='align'" in steps[6] and "from vLLM's own cache" in steps[6], steps[6]
        assert "greedy tokens from the cache -> identical" in steps[6], steps[6]
        m = re.search(r"P (\d+) tokens cached = (\d+) by vLLM's own cache \+ (\d+) loaded by LMCache", steps[7])
        assert m and int(m.group(3)) > 0 and int(m.group(1)) == int(m.group(2)) + int(m.group(3)), steps[7]
        assert "greedy tokens of both -> identical" in steps[7]
        # its control: the restored state zeroed changes the tokens
        assert re.search(r"with every state LMCache restores zeroed: restored at [1-9]\d*, greedy tokens "
                         r"\[[\d, ]+\] -> different \(ok", steps[7]), steps[7]
    else:
        assert "not available on base 0.25" in steps[7], steps[7]
    new = steps[8]
    assert "a NEW engine process" in new and "local disk backend" in new
    # the control: a stored prompt whose files were removed gets no hit in the same process
    assert re.search(r"less the [1-9]\d* of control prompt W", new), new
    assert "control, prompt W -> 0 hit tokens, 0 cached (ok" in new, new
    assert re.search(r"[1-9]\d* hit tokens loaded from disk, hybrid state restored at [1-9]\d* tokens", new), new
    assert "identical to recompute's" in new
    assert re.search(r"control, restored state zeroed: restored at [1-9]\d*, greedy tokens \[[\d, ]+\] -> "
                     r"different \(ok\)", new), new


def test_summary_table_and_result_line(demo):
    table = demo[next(i for i, line in enumerate(demo) if line.startswith("Summary")):]
    rows = [line for line in table if line.startswith(("llama4", "qwen3next", "  "))]
    align = _align_here()
    assert len(rows) == (11 if align else 7), table
    assert "refused to start" in rows[0] and rows[0].rstrip().endswith("ok")
    assert rows[1].rstrip().endswith("identical")
    if align:
        assert "vLLM's cache: " in rows[2] and "+ LMCache: " in rows[2]
        assert rows[3].rstrip().endswith("identical") and rows[4].rstrip().endswith("differ: ok")
        assert "3080-token prompt Q" in rows[5] and rows[6].rstrip().endswith("identical")
    else:
        assert "not available on base 0.25" in rows[2] and rows[2].rstrip().endswith("n/a")
    cross = rows[-4:]
    assert "new engine process" in cross[0] and "LMCache refused" in cross[0]
    assert "tokens from disk + state" in cross[0] and cross[0].rstrip().endswith("faster")
    assert cross[1].rstrip().endswith("identical")
    assert "control: W's files removed" in cross[2] and cross[2].rstrip().endswith("0: ok")
    assert "control: restored state zeroed" in cross[3] and cross[3].rstrip().endswith("differ: ok")
    assert any(line.startswith("upstream's error, streaming: \"ValueError:") for line in table)
    m = RESULT.fullmatch(demo[-1])
    assert m, demo[-1]
    assert int(m["served"]) > 0 and int(m["hit"]) > 0
    # a new process restores all but the last few tokens from disk: well above recompute
    assert float(m["speedup"]) > 1.0
    if align:
        assert int(m["lmc_cached"]) > int(m["vllm_cached"]) > 0
        assert float(m["align_ratio"]) > 0 and float(m["same_prefix_ratio"]) > 0  # timings: printed, not judged
    else:
        assert m["no_align_base"] == "0.25"


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

def _run(tokens, s=0.1, cached=0, lmc_hit=0, vllm_hit=0, restored_at=0, looked_up=True):
    return dict(s=s, tokens=tokens, cached=cached, lmc_hit=lmc_hit, vllm_hit=vllm_hit,
                restored_at=restored_at, looked_up=looked_up)


def _timed(s, cached=0, lmc_hit=0, vllm_hit=0, restored_at=0, looked_up=True):
    return dict(s=list(s), cached=[cached] * len(s), lmc_hit=[lmc_hit] * len(s),
                vllm_hit=[vllm_hit] * len(s), restored_at=[restored_at] * len(s), looked_up=looked_up)


TOKS_P, TOKS_Q, TOKS_ZEROED = [20, 21, 22, 23, 24, 25, 26, 27], [30, 31, 32, 33, 34, 35, 36, 37], [9] * 8


def _fake_results(align=True, **changes):
    """What the engine processes of a passing run report, with `changes` per run name."""
    toks = [5, 6, 7, 8, 9, 10, 11, 12]
    base = dict(crashed=False, started=True, wall_s=1.0, overlaid_modules=["vllm.x"],
                streaming_hooks=False, block_size=384)
    refused = dict(base, started=False, error="ValueError: To serve at least one request with the "
                   "model's max seq len (4096), ... the estimated maximum model length is 224. ...")
    upstream = dict(base, first={"P": _run(TOKS_P)}, recompute=_timed([0.1, 0.12]),
                    connector_attempt=dict(started=False, start_s=2.0,
                                           error="ValueError: Failed to promote local KV cache specs ..."))
    writer = dict(base, streaming_hooks=True, control_prompt=_run(toks), control_files=["w.pt", "w.pt.kvmeta"],
                  first={"P": _run(TOKS_P)}, files=["w.pt", "w.pt.kvmeta", "p.pt", "p.pt.kvmeta"])
    if align:
        upstream.update(first={"P": _run(TOKS_P), "Q": _run(TOKS_Q)},
                        repeat={"P": _timed([0.012, 0.013], cached=3072), "Q": _timed([0.0048], cached=3072)},
                        last={"P": _run(TOKS_P, cached=3072), "Q": _run(TOKS_Q, cached=3072)})
        writer.update(first={"P": _run(TOKS_P), "Q": _run(TOKS_Q)},
                      repeat={"P": _timed([0.006, 0.007], cached=3328, lmc_hit=3328, vllm_hit=3072,
                                          restored_at=3328),
                              "Q": _timed([0.005], cached=3072, lmc_hit=3072, vllm_hit=3072)},
                      last={"P": _run(TOKS_P, cached=3328), "Q": _run(TOKS_Q, cached=3072)},
                      zeroed=_run(TOKS_ZEROED, restored_at=3328))
    res = {
        "streaming-upstream-budget": refused,
        "streaming-kvstack-budget": dict(base, tokens=toks, prompt_tokens=3000, gen_s=0.2,
                                         peak_device_blocks=8, device_blocks=16,
                                         connector_stats={"capacity_tokens": 1000},
                                         streaming_hooks=True),
        "streaming-upstream-reference": dict(base, tokens=toks, device_blocks=131072),
        "lmcache-upstream": upstream,
        "lmcache-kvstack": writer,
        "lmcache-kvstack-new-process": dict(
            base, streaming_hooks=True, control_prompt=_run(toks),
            repeat=_timed([0.01, 0.011], cached=3328, lmc_hit=3328, restored_at=3328),
            last={"P": _run(TOKS_P, cached=3328)}, zeroed=_run(TOKS_ZEROED, restored_at=3328)),
    }
    for name, change in changes.items():
        res[name] = dict(res[name], **change)
    return res


def _run_fake(monkeypatch, tmp_path, capsys, align=True, **changes):
    from kvstack.testbed import demo, long_memory, tiny_models

    results = _fake_results(align, **changes)
    monkeypatch.setattr(tiny_models, "make_model", lambda name, dest: Path(dest))
    monkeypatch.setattr(tiny_models, "is_current", lambda name, dest: True)
    monkeypatch.setattr(long_memory, "long_memory_qwen3next", lambda src, dest: Path(dest))
    monkeypatch.setattr(long_memory, "is_current", lambda src, dest: True)
    monkeypatch.setattr(demo, "align_unavailable", lambda: None if align else
                        "not available on base 0.25: LMCache 0.5.3's vLLM adapter refuses ...")
    monkeypatch.setattr(demo, "_base_name", lambda: "0.32" if align else "0.25")
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
    assert m, out[-1]
    assert (m["served"], m["vllm_cached"], m["lmc_cached"], m["align_ratio"], m["same_prefix_ratio"],
            m["hit"], m["speedup"]) == ("3000", "3072", "3328", "2.00", "0.96", "3328", "10.0"), out[-1]
    assert sum(line.startswith("[") for line in out) == 9


def test_verdict_ok_without_align_mode(monkeypatch, tmp_path, capsys):
    """Base 0.25: LMCache next to vLLM's align-mode cache is not available; said so, not a failure."""
    rc, out = _run_fake(monkeypatch, tmp_path, capsys, align=False)
    assert rc == 0, out[-1]
    m = RESULT.fullmatch(out[-1])
    assert m and m["no_align_base"] == "0.25" and m["hit"] == "3328", out[-1]
    assert any("not available on base 0.25" in line for line in out if line.startswith("[8/9]"))


def test_verdict_align_ratio_below_goal_is_printed_not_failed(monkeypatch, tmp_path, capsys):
    """A timing is a figure: below the 0.95x goal it says BELOW, and the RESULT carries it."""
    writer = _fake_results()["lmcache-kvstack"]
    repeat = dict(writer["repeat"], Q=_timed([0.0096], cached=3072, lmc_hit=3072, vllm_hit=3072))
    rc, out = _run_fake(monkeypatch, tmp_path, capsys, **{"lmcache-kvstack": dict(repeat=repeat)})
    assert rc == 0
    assert RESULT.fullmatch(out[-1])["same_prefix_ratio"] == "0.50"
    assert any("0.50x (BELOW the 0.95x goal)" in line for line in out)


def _writer(**repeat_p):
    w = _fake_results()["lmcache-kvstack"]
    return dict(repeat=dict(w["repeat"], P=dict(w["repeat"]["P"], **repeat_p)))


@pytest.mark.parametrize("changes, why", [
    ({"streaming-upstream-budget": dict(started=True)}, "upstream vLLM unexpectedly started"),
    ({"streaming-upstream-reference": dict(tokens=[1] * 8)}, "streaming: greedy tokens differ"),
    ({"streaming-kvstack-budget": dict(started=False, error="RuntimeError: boom")},
     "kvstack did not serve the prompt: RuntimeError: boom"),
    ({"lmcache-upstream": dict(connector_attempt=dict(started=True, start_s=2.0))},
     "unexpectedly started LMCacheConnectorV1"),
    ({"lmcache-upstream": dict(crashed=True, error="the engine process exited with -9")},
     "the upstream engine (no connector) did not run"),
    ({"lmcache-upstream": dict(recompute=_timed([0.1], cached=3072))}, "the recompute was served from a cache"),
    ({"lmcache-upstream": dict(repeat={"P": _timed([0.2]), "Q": _timed([0.2])})},
     "vLLM's own hybrid prefix cache (align mode) did not hit"),
    ({"lmcache-kvstack": dict(crashed=True, error="the engine process exited with -9")},
     "the kvstack LMCache engine did not run"),
    ({"lmcache-kvstack": dict(control_files=[])}, "wrote no files for the control prompt"),
    ({"lmcache-kvstack": _writer(lmc_hit=[3072, 3072])}, "LMCache added nothing next to vLLM's cache"),
    ({"lmcache-kvstack": dict(last={"P": _run([1] * 8), "Q": _run(TOKS_Q)})},
     "greedy tokens differ next to vLLM's cache"),
    ({"lmcache-kvstack": dict(zeroed=_run(TOKS_P, restored_at=3328))},
     "control failed: with the restored state zeroed next to vLLM's cache"),
    ({"lmcache-kvstack": dict(zeroed=_run(TOKS_ZEROED, restored_at=0))},
     "control failed: with the restored state zeroed next to vLLM's cache"),
    ({"lmcache-kvstack-new-process": dict(control_prompt=_run([5] * 8, lmc_hit=3328, cached=3328))},
     "control failed: in the new process a prompt whose files were removed got 3328 hit tokens"),
    ({"lmcache-kvstack-new-process": dict(control_prompt=_run([5] * 8, looked_up=False))},
     "LMCache's lookup was not seen in its log"),
    ({"lmcache-kvstack-new-process": dict(repeat=_timed([0.1], cached=0))},
     "did not restore the prefix from disk"),
    ({"lmcache-kvstack-new-process": dict(last={"P": _run([1] * 8)})}, "greedy tokens differ in the new process"),
    ({"lmcache-kvstack-new-process": dict(zeroed=_run(TOKS_P, restored_at=3328))},
     "control failed: with the restored state zeroed the new process's tokens did not change"),
    ({"lmcache-kvstack-new-process": dict(started=False, error="RuntimeError: boom")},
     "the new engine process did not run"),
], ids=["upstream-starts", "stream-tokens", "stream-fails", "upstream-lmcache-starts", "upstream-crash",
        "recompute-cached", "vllm-cache-miss", "writer-crash", "no-control-files", "lmcache-adds-nothing",
        "align-tokens", "align-zeroed-same", "align-zeroed-not-restored", "removed-files-hit",
        "control-not-looked-up", "no-cross-hit", "cross-tokens", "cross-zeroed-same", "reader-fails"])
def test_verdict_fail(monkeypatch, tmp_path, capsys, changes, why):
    rc, out = _run_fake(monkeypatch, tmp_path, capsys, **changes)
    assert rc == 1
    assert out[-1].startswith("RESULT FAIL ") and why in out[-1], out[-1]
