"""LMCache's multi-process route on the CPU engine: an LMCache MP server process + LMCacheMPConnector.

Real parts only: `python -m lmcache.v1.multiprocess.server` on 127.0.0.1 (a free port), vLLM engines
in their own processes (this file, run as a script, is the engine), tokens compared with a run
without any KV connector. The server command is the one docs/hybrid-lmcache.md gives
("Two routes: in-process and multi-process"):

    python -m lmcache.v1.multiprocess.server --host 127.0.0.1 --port PORT --chunk-size C \
        --l1-size-gb 1 --eviction-policy LRU --supported-transfer-mode auto --disable-observability

(`--l1-size-gb` and `--eviction-policy` are required on LMCache 0.5.3 and 0.5.6; `auto` lets a CPU
worker use the engine-driven transfer, which 0.5.6's default `lmcache_driven` server refuses with
"No handler registered for operation register_kv_cache_engine_driven_context"; without
`--disable-observability` the server also opens a Prometheus port on 0.0.0.0:9090.)
The engine: kv_connector="LMCacheMPConnector", kv_role="kv_both", extra config
`lmcache.mp.host` = "tcp://127.0.0.1", `lmcache.mp.port` = PORT, `lmcache.mp.mq_timeout` (seconds;
the default 300 makes a missing server a 5-minute hang).

- Tiny Llama (control): the route itself on the CPU engine: a repeat in the same engine and in a
  NEW engine process loads from the server (external hit tokens), same tokens as without cache.
- Tiny Qwen3-Next (hybrid): LMCache's MP connector serves Mamba/GDN layers only with
  mamba_cache_mode="align" (vLLM then needs prefix caching on). Same checks; vLLM's own prefix cache
  is reset before the repeat, so a hit there is LMCache's. Where LMCache itself refuses hybrid KV
  groups on a CPU worker (LMCache 0.5.3 and 0.5.6 do, see KNOWN_LIMITS), the test is an xfail that
  quotes LMCache's own message; where vLLM cannot run Qwen3-Next at all on this host, a skip.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[3]

PROMPT_LLAMA = [(i * 37) % 900 + 3 for i in range(200)]  # 3 whole 64-token chunks + 8
PROMPT_QWEN = [(i * 37) % 900 + 3 for i in range(700)]  # 2 whole 288-token chunks + 124

# LMCache's own refusals of hybrid KV cache groups on a CPU worker (message, explanation).
KNOWN_LIMITS = [
    (r"engine-driven transfer does not support multiple KV transfer groups",
     "LMCache 0.5.6: the CPU worker's engine-driven transfer (the only one a CPU worker gets by "
     "default) refuses more than one KV transfer group at register_kv_caches"),
    (r"engine-driven transfer does not support hybrid KV cache groups",
     "LMCache 0.5.3: the CPU worker's engine-driven transfer refuses hybrid KV cache groups at "
     "store/retrieve (_single_group_block_ids)"),
    (r"migrate_to_shm_and_wrap requires a contiguous tensor|CpuShmTensorWrapper requires a contiguous",
     "LMCache 0.5.6 lmcache_driven on CPU: vLLM's hybrid pages are padded (block stride > block "
     "bytes), the CPU SHM wrapper takes only contiguous tensors"),
    (r"Non-tight per-block strides",
     "LMCache 0.5.6 lmcache_driven on CPU: the server's non-CUDA fallback refuses padded "
     "(non-tight) per-block strides"),
]


# --------------------------------------------------------------------------------------------
# Engine process (this file run as a script)
# --------------------------------------------------------------------------------------------

def engine_main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--port", type=int, default=0, help="LMCache MP server port; 0 = no connector")
    ap.add_argument("--max-num-batched-tokens", type=int, required=True)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--align", action="store_true", help="prefix caching + mamba_cache_mode=align")
    ap.add_argument("--reset-prefix-cache", action="store_true",
                    help="reset vLLM's own prefix cache before each prompt")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from kvstack.testbed.tiny_models import apply_engine_env, llm_kwargs

    apply_engine_env()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = llm_kwargs(args.model, args.model_dir, max_model_len=args.max_model_len,
                    max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=1,
                    enable_prefix_caching=args.align)
    if args.block_size:
        kw["block_size"] = args.block_size
    if args.align:
        kw["mamba_cache_mode"] = "align"
    if args.port:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheMPConnector", kv_role="kv_both",
            kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": args.port,
                                       "lmcache.mp.mq_timeout": 30})
    try:
        llm = LLM(**kw)
    except Exception as exc:  # report the engine's own refusal, then exit non-zero
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        os._exit(3)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    tokens, cached = [], []
    for p in json.loads(Path(args.prompts).read_text()):
        if args.reset_prefix_cache:
            llm.reset_prefix_cache()
        out = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0]
        tokens.append(list(out.outputs[0].token_ids))
        # With vLLM's own prefix cache off or reset, these are the connector's external hit tokens.
        cached.append(int(out.num_cached_tokens or 0))
    cfg = llm.llm_engine.vllm_config.cache_config
    print(json.dumps({"tokens": tokens, "cached": cached, "block_size": cfg.block_size}), flush=True)
    time.sleep(2.0)  # stores to the server are asynchronous
    os._exit(0)


# --------------------------------------------------------------------------------------------
# Test helpers
# --------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "LMCACHE_DISABLE_BANNER": "1",
            "LMCACHE_TRACK_USAGE": "false"}


def mp_server_cmd(port: int, chunk: int) -> list[str]:
    return [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1", "--port",
            str(port), "--chunk-size", str(chunk), "--l1-size-gb", "1", "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto", "--disable-observability"]


@contextmanager
def mp_server(tmp_path: Path, chunk: int):
    """An LMCache MP server on 127.0.0.1 (free port); stopped on exit, also on failure."""
    port = _free_port()
    log = tmp_path / f"mp-server-{port}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(mp_server_cmd(port, chunk), stdout=fh, stderr=subprocess.STDOUT,
                                env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"MP server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"MP server not listening:\n{log.read_text()[-4000:]}")
                time.sleep(0.2)
        yield port, log
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def run_engine(tmp_path: Path, model: str, model_dir: Path, prompts, *, mnbt: int, port: int = 0,
               align: bool = False, reset: bool = False, block_size: int | None = None):
    pfile = tmp_path / f"prompts-{time.monotonic_ns()}.json"
    pfile.write_text(json.dumps(prompts))
    cmd = [sys.executable, str(HERE), "--model", model, "--model-dir", str(model_dir), "--prompts",
           str(pfile), "--max-num-batched-tokens", str(mnbt), "--port", str(port)]
    if align:
        cmd.append("--align")
    if reset:
        cmd.append("--reset-prefix-cache")
    if block_size:
        cmd += ["--block-size", str(block_size)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    out = json.loads(lines[-1]) if lines else {}
    out["returncode"] = res.returncode
    out["log"] = res.stdout[-6000:] + "\n" + res.stderr[-20000:]
    return out


def _known_limit(*texts: str) -> str | None:
    for pattern, why in KNOWN_LIMITS:
        for text in texts:
            m = re.search(pattern, text or "")
            if m:
                return f"{why} (LMCache says: {m.group(0)!r})"
    return None


def _check_engine_ok(out: dict, what: str) -> None:
    if out["returncode"] != 0 or "tokens" not in out:
        raise AssertionError(f"{what} failed ({out['returncode']}): {out.get('error')}\n{out['log'][-8000:]}")


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------

if __name__ != "__main__":
    import pytest

    pytest.importorskip("vllm")
    pytest.importorskip("lmcache")
    sys.path.insert(0, str(REPO))

    @pytest.fixture(scope="module")
    def tiny(tmp_path_factory):
        from kvstack.testbed.tiny_models import make_model

        root = tmp_path_factory.mktemp("tiny-models")
        return lambda name: make_model(name, root / name)

    def test_mp_route_llama_control(tiny, tmp_path):
        """The route itself on the CPU engine (non-hybrid model, vLLM's prefix cache off): the repeat
        in the same engine and a NEW engine process both load 192 tokens (3 chunks of 64) from the
        server, with the tokens of a run without connector."""
        model = tiny("llama")
        base = run_engine(tmp_path, "llama", model, [PROMPT_LLAMA], mnbt=64)
        _check_engine_ok(base, "baseline engine")
        with mp_server(tmp_path, chunk=64) as (port, log):
            a = run_engine(tmp_path, "llama", model, [PROMPT_LLAMA, PROMPT_LLAMA], mnbt=64, port=port)
            _check_engine_ok(a, "engine A")
            b = run_engine(tmp_path, "llama", model, [PROMPT_LLAMA], mnbt=64, port=port)
            _check_engine_ok(b, "engine B")
        assert a["tokens"] == [base["tokens"][0]] * 2 and b["tokens"] == base["tokens"]
        assert a["cached"] == [0, 192], a["cached"]
        assert b["cached"] == [192], b["cached"]

    def test_mp_route_qwen3next(tiny, tmp_path):
        """Tiny Qwen3-Next through the LMCache MP server: engine A computes and repeats the prompt
        (vLLM's prefix cache reset first: the hit must be LMCache's), a NEW engine B repeats it too;
        tokens equal a run without connector."""
        model = tiny("qwen3next")
        # vLLM sizes the attention block to the Mamba page in align mode: 32 -> 288 tokens on the
        # tiny model; LMCache's chunk must be a multiple of it; 0.5.3 wants steps of one block.
        blk = 288
        base = run_engine(tmp_path, "qwen3next", model, [PROMPT_QWEN], mnbt=blk)
        if base["returncode"] in (-signal.SIGILL, 128 + signal.SIGILL):
            pytest.skip("vLLM cannot run Qwen3-Next on this host at all (no connector): the engine dies "
                        "with SIGILL in the CPU gated-delta-net kernel (chunk_gated_delta_rule_cpu, "
                        "AMX brgemm on torch 2.11, vLLM 0.25.1); nothing of the MP route can be checked")
        _check_engine_ok(base, "baseline engine")
        with mp_server(tmp_path, chunk=blk) as (port, log):
            a = run_engine(tmp_path, "qwen3next", model, [PROMPT_QWEN, PROMPT_QWEN], mnbt=blk, port=port,
                           align=True, reset=True, block_size=32)
            server_log = log.read_text()
            if a["returncode"] != 0 or a.get("cached", [0, 0])[1] == 0:
                why = _known_limit(a.get("error", ""), a["log"], server_log)
                if why:
                    # Tokens must still be right where the engine ran.
                    if "tokens" in a:
                        assert a["tokens"] == [base["tokens"][0]] * 2
                    pytest.xfail(f"LMCache MP route cannot serve a hybrid model on a CPU worker: {why}")
            _check_engine_ok(a, "engine A")
            assert a["block_size"] == blk, a["block_size"]
            b = run_engine(tmp_path, "qwen3next", model, [PROMPT_QWEN], mnbt=blk, port=port, align=True,
                           reset=True, block_size=32)
            _check_engine_ok(b, "engine B")
        assert a["tokens"] == [base["tokens"][0]] * 2 and b["tokens"] == base["tokens"]
        assert a["cached"][0] == 0 and a["cached"][1] >= blk, a["cached"]
        assert b["cached"] == [a["cached"][1]], b["cached"]


if __name__ == "__main__":
    sys.exit(engine_main())
