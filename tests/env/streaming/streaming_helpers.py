"""Helpers for the streaming tests: engines with/without the kvstack connector, prompts."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from kvstack.testbed.engine import shutdown_llm
from kvstack.testbed.tiny_models import writer_lock

ROOT = Path(__file__).resolve().parents[3]
SITE = ROOT / ".venv" / "lib" / "python3.11" / "site-packages"
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
HMA_ENV = "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE"


def hooks_applied() -> bool:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    except Exception:  # noqa: BLE001
        return False
    return hasattr(KVConnectorBase_V1, "get_kv_paging_window")


def request_refused_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses up front (e.g. a prompt longer than
    max_model_len). vLLM 0.25.1: a ValueError (its VLLMValidationError is one). vLLM 0.32.0:
    VLLMValidationError, which is no longer a ValueError."""
    from vllm.exceptions import VLLMValidationError

    return (ValueError, VLLMValidationError)


def vllm_check_reserves_null_block() -> bool:
    """Whether vLLM's own start-up KV check keeps vLLM's null block out of the budget. vLLM
    0.25.1: no, so a budget of exactly the blocks one request needs starts and the streaming
    connector refuses it itself (validate.check_device_budget). vLLM 0.32.0: yes
    (get_kv_cache_configs checks the pool minus one block), so vLLM refuses that budget first."""
    import vllm

    return tuple(int(x) for x in vllm.__version__.split(".")[:2]) >= (0, 32)


# The hooks patch is in the series, so the venv always has it: tests that use the hooks are only
# marked (test_hooks.py::test_hooks_are_applied fails loudly when the patch is missing).
needs_hooks = pytest.mark.streaming_hooks


@contextlib.contextmanager
def env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    for k, v in kv.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def tiny_model(name: str) -> Path:
    from kvstack.testbed.tiny_models import make_model

    return Path(make_model(name, ROOT / "build" / "tiny-models" / name))


def streaming_transfer_config(**extra):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="StreamingConnector", kv_role="kv_both",
                            kv_connector_module_path="kvstack.streaming",
                            kv_connector_extra_config=extra)


def make_llm(name: str, *, streaming: dict | None = None, **overrides):
    """An LLM for tiny model `name`; with `streaming` (extra config) the kvstack connector."""
    return make_llm_from(tiny_model(name), name, streaming=streaming, **overrides)


def scheduler_connector(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


close = shutdown_llm


def prompt(n: int, salt: int = 0) -> dict:
    return {"prompt_token_ids": [3 + (i * 7 + salt * 13 + 3) % 1000 for i in range(n)]}


def greedy(max_tokens: int = 8):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def tokens(llm, prompts, max_tokens: int = 8):
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(max_tokens),
                                                              use_tqdm=False)]


# ---- a "sharp" tiny Llama-4 (issue 13: comparisons that can fail) ------------------------------
#
# The tiny random Llama-4 attends almost uniformly and its logits are almost flat (top logprob
# about -6.4 for a vocabulary of 1024): changing one token far back in a long history moves its
# top logprobs by about 0.004, and its greedy tokens are decided by margins that small, so a
# streaming-vs-native comparison on it says little about streaming attention. The sharp copy
# keeps every weight but these of the NoPE layer (layer 3, the layer kvstack streams) and the
# residual stream around it:
#
# - q/k of layer 3 become a scaled matched filter: the K projection of KV head g is the Q
#   projection of its first query head, shared by both query heads of the group, times
#   `qk_scale` each (q.k grows by qk_scale**2). A query then attends, peaked, to the earlier
#   tokens whose layer-3 input is its own: the earlier occurrences of the same token (and
#   itself). Scaling q/k alone (x8-x16, untied) moved the outputs by 0.002-0.04 only.
# - the token embedding x `embed_scale`: the residual stream at layer 3 is then mostly the token
#   itself (layers 0-2 only add to it; RMSNorm makes every layer's input scale-free).
# - o_proj of layer 3 x `o_scale`: what layer 3 retrieves dominates the last hidden state.
# - lm_head x `lm_head_scale`: the logits are peaked enough that a different retrieval shows.
#
# Layers 0-2 are chunked-local (chunk 32): a token before position 64 reaches an output at
# position 700+ only through layer 3's attention over the history, i.e. through what kvstack
# streams from its host tier.
SHARP = dict(qk_scale=16.0, embed_scale=4.0, o_scale=16.0, lm_head_scale=16.0)
SHARP_LAYER = "model.layers.3.self_attn."
_SHARP_DONE: dict[tuple, Path] = {}


def sharp_llama4(dest: Path | None = None, **scales) -> Path:
    """Write (once per session; kept across sessions while the recipe is the same) the sharp copy
    of the tiny Llama-4 into build/tiny-models/llama4-sharp and return its directory. Config and
    tokenizer files are the tiny Llama-4's."""
    import hashlib
    import json

    recipe = dict(SHARP, **scales)
    dest = Path(dest or ROOT / "build" / "tiny-models" / "llama4-sharp")
    key = (str(dest), tuple(sorted(recipe.items())))
    if key in _SHARP_DONE:
        return _SHARP_DONE[key]
    src = tiny_model("llama4")
    src_digest = hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest()
    stamp = {"recipe": recipe, "source_sha256": src_digest, "version": 1}

    def current() -> bool:
        try:
            return json.loads((dest / ".kvstack-sharp.json").read_text()) == stamp
        except (OSError, ValueError):
            return False

    if not current():
        with writer_lock(dest):  # pytest-xdist workers: one writes it, the others then keep it
            if not current():
                _write_sharp(src, dest, recipe, stamp)
    _SHARP_DONE[key] = dest
    return dest


def _write_sharp(src: Path, dest: Path, recipe: dict, stamp: dict) -> None:
    """Write the sharp copy into `dest` (beside it, then renamed in)."""
    import json
    import shutil
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    sd = {k: v.float() for k, v in load_file(src / "model.safetensors").items()}
    q = sd[SHARP_LAYER + "q_proj.weight"]  # [Hq * D, hidden]
    k = sd[SHARP_LAYER + "k_proj.weight"]  # [Hkv * D, hidden]
    head = 32
    hq, hkv = q.shape[0] // head, k.shape[0] // head
    rep = hq // hkv
    kq = q.view(hq, head, -1)[0::rep].clone()  # first query head of each KV group
    sd[SHARP_LAYER + "k_proj.weight"] = (kq * recipe["qk_scale"]).reshape(k.shape)
    sd[SHARP_LAYER + "q_proj.weight"] = (kq.repeat_interleave(rep, 0)
                                         * recipe["qk_scale"]).reshape(q.shape)
    sd["model.embed_tokens.weight"] *= recipe["embed_scale"]
    sd[SHARP_LAYER + "o_proj.weight"] *= recipe["o_scale"]
    sd["lm_head.weight"] *= recipe["lm_head_scale"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".llama4-sharp-", dir=dest.parent))
    tmp.chmod(0o755)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors" and not f.name.startswith("."):
            shutil.copy2(f, tmp / f.name)
    save_file({n: t.to(torch.bfloat16).contiguous() for n, t in sd.items()},
              str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "model.safetensors").chmod(0o644)
    (tmp / ".kvstack-sharp.json").write_text(json.dumps(stamp))
    old = None
    if dest.exists():  # swap in atomically enough for concurrent sessions
        old = dest.with_name(dest.name + f".old-{os.getpid()}")
        dest.rename(old)
    tmp.rename(dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def make_llm_from(model_dir: Path, name: str = "llama4", *, streaming: dict | None = None,
                  exact: bool = True, **overrides):
    """`make_llm` for a model written elsewhere (e.g. `sharp_llama4()`), run like tiny `name`.
    `exact`: for a streaming-vs-native logprob comparison (the dtype of
    `tiny_models.cpu_exactness_dtype` on AMX hosts)."""
    from kvstack.testbed.tiny_models import cpu_exactness_dtype, llm_kwargs
    from vllm import LLM

    kw = llm_kwargs(name, model_dir, enable_prefix_caching=False, **overrides)
    if exact and "dtype" not in overrides and cpu_exactness_dtype():
        kw["dtype"] = cpu_exactness_dtype()  # AMX hosts: see tiny_models.cpu_exactness_dtype
    if streaming is not None:
        kw["kv_transfer_config"] = streaming_transfer_config(**streaming)
        with env(**{HMA_ENV: "1"}):
            return LLM(**kw)
    with env(**{HMA_ENV: None}):
        return LLM(**kw)


def greedy_logprobs(llm, prompts, max_tokens: int = 16, logprobs: int = 5):
    """Greedy tokens and, per generated position, the top-`logprobs` {token: logprob}."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


def logprob_gap(a, b) -> float:
    """Largest |logprob difference| over the generated positions of two `greedy_logprobs`
    results (token lists, top-k dicts), over the tokens both top-k lists hold at a position;
    inf when the greedy tokens differ (the positions then condition on different tokens)."""
    (ta, la), (tb, lb) = a, b
    if ta != tb:
        return float("inf")
    gap = 0.0
    for da, db in zip(la, lb):
        for t in set(da) & set(db):
            gap = max(gap, abs(da[t] - db[t]))
    return gap
