"""Issue 27, MLA: an MLA model (the tiny DeepSeek-V2, a 576-wide latent KV cache with one "head")
with LMCacheConnectorV1 serves exact on the CPU engine, and a repeat hits LMCache.

vLLM 0.32 hands each MLA layer's latent cache to LMCache as its generic 4-D view
[num_blocks, block_size, 1, 576]. LMCache's CPU path (LMCache patch 0001) read that as packed K|V
rows and failed the first request ("paged KV (N, 16, 1, 576) read as NL_X_NB_BS_NH_CS ... does not
match the memory object (1, 2, 32, 576)"); it now drops the one-head axis for MLA models and moves
the latent rows as the MLA layout (NL_X_NB_BS_HS).

What stock means here: stock LMCache has no CPU path at all (its CreateGPUConnector raises "No
supported cpu connector found" on the CPU engine, for every model), so no stock vLLM + LMCache run
exists to compare with. The reference is stock vLLM with no connector (the installed vLLM with
kvstack's vLLM series taken out, kvstack.release.overlay, but for the one fix stock needs to start
on the CPU engine at all), on the same prompts, a prompt and its repeat, with vLLM's own prefix
cache kept on (engine_run.py --prefix-caching; vLLM's CPU platform turns it off for MLA models):
- the first prompt is a full prefill on both sides: kvstack's tokens must equal stock's;
- the repeat runs from a cached 128-token prefix on both sides, vLLM's own on stock, the latent KV
  LMCache restored on kvstack, through the same cached-context prefill: the tokens must be equal
  again, and LMCache's hit must be the prefix vLLM's cache held (both 128 tokens of 140 on any
  block size vLLM picks: 16, 32 or 128). A full recompute is not the reference for the repeat:
  on vLLM 0.32's CPU MLA backends the cached-context prefill does not give a full prefill's tokens
  even with vLLM's own exact KV (measured in float32 too: the first token's logprob moves by 0.03),
  which may be why vLLM keeps prefix caching off for MLA on the CPU.
The controls: the stock side must have run stock's vLLM (no SupportsHMA on its LMCacheConnectorV1),
or the two sides ran the same code; and a kvstack run whose restored latent KV is zeroed
(--zero-restored-kv-from 1) must change the repeat's tokens, so the restored KV is what decides
them. vLLM 0.25.1's CPU engine refuses MLA models ("MLA is not supported on CPU"): there the test
records "refused by upstream" when kvstack refuses too. The transfer test below checks the
connector on the 4-D MLA cache on both bases without an engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
CHUNK = 32
PROMPT = [(i * 53) % 900 + 3 for i in range(140)]  # LMCache's and vLLM's cached prefix: 128
PREFIX = 128

@pytest.fixture(scope="module")
def stock_overlay(tmp_path_factory):
    """Stock vLLM (kvstack's series taken out again, but for the CPU-engine start-up fix)."""
    from kvstack.testbed.family_table import build_stock_overlay

    return build_stock_overlay(tmp_path_factory.mktemp("stock") / "overlay")


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    from kvstack.testbed.tiny_models import make_model

    return make_model("deepseek_v2", tmp_path_factory.mktemp("models") / "deepseek_v2")


def _run(model_dir: Path, tmp: Path, overlay: Path | None, *flags: str) -> dict:
    """The engine's JSON line, or {"failed": the end of its output} when it did not serve."""
    pfile = tmp / f"prompts-{time.monotonic_ns()}.json"
    pfile.write_text(json.dumps([PROMPT, PROMPT]))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "HF_HUB_OFFLINE": "1", "LMCACHE_CHUNK_SIZE": str(CHUNK), "LMCACHE_LOCAL_CPU": "True",
           "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5", "LMCACHE_DISABLE_BANNER": "1",
           "KVSTACK_LMCACHE_FLUSH_S": "0"}  # local CPU backend only: nothing to flush
    env.pop("KVSTACK_OVERLAY", None)
    if overlay is not None:
        env["KVSTACK_OVERLAY"] = str(overlay)
    res = subprocess.run([sys.executable, str(HERE / "engine_run.py"), "--model", "deepseek_v2",
                          "--model-dir", str(model_dir), "--prompts", str(pfile), *flags],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"failed": f"exit {res.returncode}:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"}
    return json.loads(lines[-1])


def test_mla_model_with_lmcache_serves_exact_and_repeat_hits(mla_model, stock_overlay, tmp_path):
    stock = _run(mla_model, tmp_path, stock_overlay, "--prefix-caching")
    ours = _run(mla_model, tmp_path, None, "--lmcache")
    if "failed" in stock:
        # refused by upstream (vLLM 0.25.1's CPU attention selector: "MLA is not supported on
        # CPU"): kvstack is then no worse if it refuses too
        assert "failed" in ours, "stock failed where kvstack served: " + stock["failed"]
        print("deepseek_v2 (MLA) + LMCache: refused by upstream, and by kvstack: "
              f"{stock['failed'].strip().splitlines()[-1][:200]}")
        return
    assert "failed" not in ours, "stock vLLM serves the MLA model, kvstack + LMCache failed: " + \
        ours["failed"]
    # the control: the stock side ran stock vLLM's code (kvstack's LMCacheConnectorV1 has SupportsHMA)
    assert not stock["lmcache_supports_hma"] and ours["lmcache_supports_hma"]
    assert stock["groups"] == ours["groups"] == ["MLAAttentionSpec"]
    # full prefill on both sides
    assert ours["tokens"][0] == stock["tokens"][0], (ours["tokens"], stock["tokens"])
    # the repeat: the same cached prefix on both sides (vLLM's own / LMCache's), the same tokens
    assert stock["cached"] == [0, PREFIX], stock["cached"]
    assert ours["hits"] == [0, PREFIX] and ours["cached"] == [0, PREFIX], (ours["hits"], ours["cached"])
    assert ours["tokens"][1] == stock["tokens"][1], (ours["tokens"], stock["tokens"])

    # the control: a wrong restored latent KV changes the repeat's tokens
    zeroed = _run(mla_model, tmp_path, None, "--lmcache", "--zero-restored-kv-from", "1")
    assert "failed" not in zeroed, zeroed.get("failed")
    assert zeroed["hits"][1] == PREFIX
    assert zeroed["tokens"][0] == ours["tokens"][0]
    assert zeroed["tokens"][1] != ours["tokens"][1], "zeroing the restored KV changed no token"


def test_cpu_connector_moves_the_4d_mla_latent_cache():
    """The connector on vLLM 0.32's MLA cache view, [num_blocks, block_size, 1, 576]: a chunk is
    read from and written to its slots' latent rows (one row per token, no K/V split), and
    nothing else of the engine's tensor changes."""
    import lmcache
    from lmcache.utils import EngineType
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import CreateGPUConnector
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata

    assert lmcache.torch_device_type == "cpu"
    nl, nb, bs, width, chunk = 2, 6, 16, 576, 8
    config = LMCacheEngineConfig.from_defaults(chunk_size=chunk, local_cpu=True,
                                               max_local_cpu_size=0.1)
    meta = LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(nl, 1, chunk, 1, width), use_mla=True)

    class Obj:  # the two attributes the connector uses of a MemoryObj
        def __init__(self, t):
            self.tensor = t
            self.metadata = type("M", (), {"fmt": MemoryFormat.KV_MLA_FMT})()

    gen = torch.Generator().manual_seed(27)
    layers = [torch.randn(nb, bs, 1, width, generator=gen).to(torch.bfloat16) for _ in range(nl)]
    slots = torch.tensor([19, 20, 21, 22, 40, 41, 42, 43])  # two blocks' worth, out of order pages
    conn = CreateGPUConnector(config, meta, EngineType.VLLM)
    assert conn.get_shape(chunk) == torch.Size([1, nl, chunk, width])
    out = Obj(torch.zeros(conn.get_shape(chunk), dtype=torch.bfloat16))
    conn.from_gpu(out, 0, chunk, kvcaches=layers, slot_mapping=slots)
    for layer, paged in enumerate(layers):
        rows = paged.view(nb * bs, width)[slots]
        assert torch.equal(out.tensor[0, layer], rows)

    target = [torch.randn(nb, bs, 1, width, generator=gen).to(torch.bfloat16) for _ in range(nl)]
    before = [t.clone() for t in target]
    conn2 = CreateGPUConnector(config, meta, EngineType.VLLM)
    conn2.to_gpu(out, 0, chunk, kvcaches=target, slot_mapping=slots)
    for layer, (new, old) in enumerate(zip(target, before)):
        flat_new, flat_old = new.view(nb * bs, width), old.view(nb * bs, width)
        assert torch.equal(flat_new[slots], out.tensor[0, layer])
        others = torch.ones(nb * bs, dtype=torch.bool)
        others[slots] = False
        assert torch.equal(flat_new[others], flat_old[others])
