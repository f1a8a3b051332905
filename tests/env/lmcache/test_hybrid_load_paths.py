"""LMCache's load and save paths that bypass a hybrid model's recurrent state are refused at start-up
(LMCache patch "hybrid models: refuse the load paths that bypass the state", issue 29 point 2), and
so is a capped load (`lmcache.max_tokens_per_load`).

A hybrid request's state is looked up with its K/V, restored on the synchronous whole-request load and
saved with its chunks; asynchronous loading, layerwise loading/saving and blending would move K/V
without the state that goes with it, and with save_decode_cache a prompt extending decoded text hit
chunks saved at decode steps with a state that does not match (measured on the long-memory Qwen3-Next:
a 160-token hit and 78 of 80 tokens other than recompute on base 0.32, 60 of 80 on 0.25; 64 tokens and
exact without it). Each is refused when the engine starts, naming the setting and
how to turn it off; the dense model starts with the same setting (the refusal is for hybrids only),
and the hybrid model starts without it (the control)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

pytestmark = pytest.mark.env

REPO = Path(__file__).resolve().parents[3]
START = """
import os, sys
sys.path.insert(0, {repo!r})
from kvstack.testbed.tiny_models import apply_engine_env, llm_kwargs
apply_engine_env()
from vllm import LLM
from vllm.config import KVTransferConfig
llm = LLM(**llm_kwargs({name!r}, {model_dir!r}, enable_prefix_caching=False,
          kv_transfer_config=KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both",
                                              kv_connector_extra_config={extra!r})))
print("@@STARTED", flush=True)
os._exit(0)
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from kvstack.testbed.tiny_models import make_model

    root = tmp_path_factory.mktemp("paths-models")
    return lambda name: make_model(name, root / name)


def start(models, name: str, extra: dict | None = None, **env: str) -> subprocess.CompletedProcess:
    code = START.format(repo=str(REPO), name=name, model_dir=str(models(name)), extra=extra or {})
    full = {**os.environ, "LMCACHE_CHUNK_SIZE": "32", "LMCACHE_LOCAL_CPU": "True",
            "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5", "LMCACHE_DISABLE_BANNER": "1", **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, timeout=600)


@pytest.mark.parametrize("setting", ["LMCACHE_USE_LAYERWISE", "LMCACHE_ENABLE_ASYNC_LOADING",
                                     "LMCACHE_SAVE_DECODE_CACHE"])
def test_hybrid_model_refuses_a_path_that_bypasses_the_state(models, setting):
    res = start(models, "qwen3next", **{setting: "True"})
    out = res.stdout + res.stderr
    assert "@@STARTED" not in out, out[-3000:]
    name = setting.removeprefix("LMCACHE_").lower()
    assert f"hybrid (Mamba/GDN) model does not support {name}" in out, out[-3000:]
    assert f"{setting}=False" in out, out[-3000:]


def test_hybrid_model_refuses_a_capped_load(models):
    """lmcache.max_tokens_per_load (chunked loads) cuts a load where no state was saved: refused."""
    res = start(models, "qwen3next", extra={"lmcache.max_tokens_per_load": 512})
    out = res.stdout + res.stderr
    assert "@@STARTED" not in out, out[-3000:]
    assert "hybrid (Mamba/GDN) model does not support lmcache.max_tokens_per_load (512)" in out, out[-3000:]
    res = start(models, "llama", extra={"lmcache.max_tokens_per_load": 512})  # dense: LMCache's own
    assert "@@STARTED" in res.stdout, (res.stdout + res.stderr)[-3000:]


def test_without_it_the_hybrid_model_starts_and_a_dense_one_with_it(models):
    res = start(models, "qwen3next")
    assert "@@STARTED" in res.stdout, (res.stdout + res.stderr)[-3000:]
    res = start(models, "llama", LMCACHE_USE_LAYERWISE="True")
    assert "@@STARTED" in res.stdout, (res.stdout + res.stderr)[-3000:]
