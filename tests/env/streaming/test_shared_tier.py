"""The streaming host tier backed by LMCache's storage (issue 17, point 2; shared_tier.py).

Engine processes that share nothing but an LMCache backend, a real server on 127.0.0.1 that the
test starts and stops (`lmcache_server`, `redis-server`; kvstack/testbed/backend_servers.py):

- R (reference): the same engine configuration without the shared tier: the recompute's tokens and
  TTFT for three long prompts B1, B2, B3 (3,880 tokens each).
- A: computes the prefixes A1, A2, A3 of those prompts with the shared tier and exits.
- B: a new process with its own, empty host tier. B1 (extends A1) hits the backend: R's tokens,
  and its TTFT against R's printed (a figure, not asserted: a timed verdict depends on the
  machine and its load; the hit itself, all but the new tokens restored, is asserted). B3 (extends A3; redis only) is the negative
  control: every restored page is zeroed before it reaches the host tier, and the tokens must then
  differ from R's (the sharp model retrieves from its history, so a wrong restore shows). The server is then killed, and B2 (extends A2) is recomputed: R's
  tokens, no hit, a warning in B's log, the engine alive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from streaming_helpers import needs_hooks, prompt, sharp_llama4  # noqa: E402

from kvstack.testbed.backend_servers import start_or_skip, stop  # noqa: E402

RUNNER = Path(__file__).with_name("shared_tier_run.py")
PROMPT_TOKENS = 3840  # 30 full pages: B computes only its 40 new tokens
EXTRA = [3 + (i * 11) % 1000 for i in range(40)]
MAX_TOKENS = 8
PAGE = 128  # 30 objects for a prompt (8 KiB pages of 32 tokens would be 121: more round trips)
# the scheduler's token budget per step, the same in every engine: on 2 CPU cores the tiny model
# computes a 3,900-token prompt in ~0.1 s at 256 (its cost is mostly per step, not per token); at
# 64 the recompute took ~0.3 s against a ~30 ms hit, 9.7x-12.7x; at 32 ~0.57 s: 19.4x / 19.6x
# (base 0.25 / 0.32, 2026-11-24); printed, not asserted
BUDGET = 32


def _prompts():
    a = [prompt(PROMPT_TOKENS, salt=s)["prompt_token_ids"] for s in (0, 1, 2)]
    return a, [p + EXTRA for p in a]


def run_engine(model: Path, prompts: list[list[int]], tmp: Path, lmcache: dict | None = None,
               *args: str) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    pfile = tmp / "prompts.json"
    pfile.write_text(json.dumps(prompts))
    cmd = [sys.executable, str(RUNNER), "--model-dir", str(model), "--prompts", str(pfile),
           "--max-tokens", str(MAX_TOKENS), "--page-tokens", str(PAGE),
           "--max-num-batched-tokens", str(BUDGET), *args]
    if lmcache is not None:
        cmd += ["--lmcache", json.dumps(lmcache)]
    env = {**os.environ, "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    (tmp / "log.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"engine failed ({proc.returncode}): {proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model():
    return sharp_llama4()


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """R: the recompute (same engine, no shared tier) of B1, B2, B3."""
    _, b = _prompts()
    return run_engine(model, b, tmp_path_factory.mktemp("reference"))


def _default_base_only():
    from kvtest import on_default_base

    return pytest.mark.skipif(
        not on_default_base(),
        reason="lmcache_server runs on the default base only (CI time); redis covers this base")


@needs_hooks
@pytest.mark.parametrize("backend", ["redis", pytest.param("lmcache_server",
                                                           marks=_default_base_only())])
def test_new_engine_process_reuses_a_long_prefix_from_the_backend(backend, model, reference,
                                                                  tmp_path):
    a, b = _prompts()
    server, url = start_or_skip(backend, tmp_path)
    try:
        lmc = {"remote_url": url}
        ra = run_engine(model, a, tmp_path / "a", lmc)
        assert ra["hit"] == [0, 0, 0], ra
        assert ra["stats"]["shared_saved_pages"] >= 3 * (PROMPT_TOKENS // PAGE), ra["stats"]

        # B: B1 restored; (redis) B3 restored wrongly on purpose; server killed; B2 recomputed
        order = [b[0], b[2], b[1]] if backend == "redis" else [b[0], b[1]]
        args = ["--kill-pgid", str(server.pid), "--kill-before", str(len(order) - 1)]
        if backend == "redis":
            args += ["--mutate-prompt", "1"]
        rb = run_engine(model, order, tmp_path / "b", lmc, *args)
        ref = dict(zip(("B1", "B2", "B3"), reference["tokens"]))
        ref_ttft = reference["ttft"][0]
        hit_tokens = (PROMPT_TOKENS // PAGE) * PAGE
        print(f"\n[{backend}] B1 ({len(b[0])} tokens): TTFT {rb['ttft'][0] * 1e3:.0f} ms from the "
              f"shared tier ({rb['hit'][0]} tokens restored) vs {ref_ttft * 1e3:.0f} ms recompute "
              f"= {ref_ttft / rb['ttft'][0]:.1f}x; backend killed: B2 TTFT "
              f"{rb['ttft'][-1] * 1e3:.0f} ms (recompute); fetch {rb['stats']['shared_fetch_ms']:.0f} ms "
              f"in all ({rb['stats']['shared_hit_pages']} pages)")
        assert rb["hit"][0] == hit_tokens, rb
        assert rb["tokens"][0] == ref["B1"]
        if backend == "redis":
            # TTFT from the backend vs recompute: the better of B's two hits (B1, B3: the same
            # fetch and restore) against the better of R's recomputes. Printed, not asserted: a
            # CI run on a loaded 2-core machine once measured 37 ms vs 349 ms (9.5x) where idle
            # runs gave 19.4x-19.6x; the speed-up is a bench figure (docs/streaming-usage.md), the
            # hit is asserted
            hit_ttft = min(rb["ttft"][0], rb["ttft"][1])
            best_ref = min(reference["ttft"])
            print(f"[{backend}] best hit TTFT {hit_ttft * 1e3:.0f} ms vs best recompute "
                  f"{best_ref * 1e3:.0f} ms = {best_ref / hit_ttft:.1f}x "
                  f"(B: {rb['ttft']}, R: {reference['ttft']})")
            assert rb["stats"]["shared_hit_pages"] >= 2 * (PROMPT_TOKENS // PAGE), rb["stats"]
            # negative control: the comparison can fail
            assert rb["hit"][1] == hit_tokens and rb["tokens"][1] != ref["B3"], rb
        # the backend is gone: a miss, the recompute's tokens, a warning, the engine alive
        assert rb["hit"][-1] == 0 and rb["tokens"][-1] == ref["B2"], rb
        assert any("kvstack" in w and "shared tier" in w for w in rb["warnings"]) or any(
            "lmcache" in w.lower() and ("fail" in w.lower() or "error" in w.lower())
            for w in rb["warnings"]), rb["warnings"]
    finally:
        stop(server)


@needs_hooks
def test_refused_configurations(tmp_path):
    from kvstack.streaming.config import StreamingConfig

    for bad, says in [({"remote_url": "lm://x:1", "bogus": 1}, "unknown"),
                      ({}, "no backend"),
                      ({"remote_url": "lm://x:1", "local_cpu": True}, "local_cpu"),
                      ({"remote_url": "lm://x:1", "remote_serde": "cachegen"}, "naive"),
                      ({"remote_url": "127.0.0.1:1"}, "URL"),
                      ({"local_disk": str(tmp_path)}, "max_local_disk_size"),
                      ("lm://x:1", "dict")]:
        with pytest.raises(ValueError, match=says):
            StreamingConfig.from_extra({"lmcache": bad})
    cfg = StreamingConfig.from_extra({"lmcache": {"remote_url": "redis://127.0.0.1:1"}})
    assert cfg.lmcache_config["local_cpu"] is False
    assert cfg.lmcache_config["remote_serde"] == "naive"
