"""The tiny local models: deterministic files, a working tokenizer, and real CPU-engine runs.

Each model is started once in the real vLLM CPU engine (module-scoped, one engine alive at a time)
and checked for: the KV-cache layout the model is meant to exercise (full / chunked-local / linear
attention layers), the requested number of greedy tokens, and equal tokens on repeated runs.
"""

from __future__ import annotations

import json
import os

import pytest

from kvstack.testbed import tiny_models

pytestmark = pytest.mark.env

PROMPTS = [tiny_models.DEMO_PROMPT, "Blocks are the unit of the paged cache, and a request owns"]
MAX_TOKENS = 12

# Per model: the vLLM KV-cache spec class of each decoder layer.
EXPECTED_LAYER_SPECS = {
    "llama": ["FullAttentionSpec"] * 2,
    "llama4": ["ChunkedLocalAttentionSpec"] * 3 + ["FullAttentionSpec"],
    "qwen3next": ["MambaSpec"] * 3 + ["FullAttentionSpec"],
    "gemma2": ["SlidingWindowSpec", "FullAttentionSpec"] * 2,
}


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# ---- files -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", tiny_models.MODEL_NAMES)
def test_two_builds_are_byte_identical(name, tiny_model_dir, tmp_path):
    first = tiny_model_dir(name)
    second = tiny_models.make_model(name, tmp_path / name)
    a, b = _files(first), _files(second)
    assert sorted(a) == sorted(b)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(a)
    differ = [f for f in a if a[f] != b[f]]
    assert not differ, f"{name}: files differ between two builds: {differ}"


def test_config_and_tokenizer(tiny_model_dir):
    from transformers import AutoConfig, AutoTokenizer

    for name in tiny_models.MODEL_NAMES:
        folder = tiny_model_dir(name)
        config = AutoConfig.from_pretrained(folder)
        assert config.architectures == [tiny_models.MODELS[name].architecture]
        assert config.vocab_size == tiny_models.VOCAB_SIZE
        assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
        tok = AutoTokenizer.from_pretrained(folder)
        assert len(tok) <= config.vocab_size
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
            config.bos_token_id, config.eos_token_id, config.pad_token_id)
        text = "The KV cache grows: 1024 tokens, {\"a\": 3.14} and ünïcödé."
        ids = tok(text).input_ids
        assert ids[0] == tok.bos_token_id and max(ids) < config.vocab_size
        assert tok.decode(ids, skip_special_tokens=True) == text  # byte-level: nothing is lost
    llama4 = AutoConfig.from_pretrained(tiny_model_dir("llama4"))
    assert llama4.no_rope_layers == [1, 1, 1, 0] and llama4.attention_chunk_size == 32
    assert llama4.num_local_experts == 2


def test_make_model_keeps_a_current_model_and_repairs_a_changed_one(tiny_model_dir, tmp_path):
    dest = tmp_path / "llama"
    tiny_models.make_model("llama", dest)
    weights = dest / "model.safetensors"
    stamp = os.stat(weights)
    assert tiny_models.make_model("llama", dest) == dest.absolute()
    assert os.stat(weights).st_mtime_ns == stamp.st_mtime_ns and os.stat(weights).st_ino == stamp.st_ino

    (dest / "config.json").write_text("{}")  # a damaged file is noticed and the model rebuilt
    assert not tiny_models.is_current("llama", dest)
    tiny_models.make_model("llama", dest)
    assert _files(dest) == _files(tiny_model_dir("llama"))
    assert not tiny_models.is_current("llama4", dest)  # a folder holds one model, by name


def test_make_model_refuses_a_foreign_folder(tmp_path):
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError):
        tiny_models.make_model("llama", dest)
    assert (dest / "notes.txt").read_text() == "not a model"
    with pytest.raises(ValueError, match="unknown tiny model"):
        tiny_models.make_model("gpt5", tmp_path / "x")


def test_cli(tmp_path, capsys):
    assert tiny_models.main(["--out", str(tmp_path), "llama"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("llama: wrote ") and str(tmp_path / "llama") in first
    assert tiny_models.main(["--out", str(tmp_path), "llama", "--print-engine-args"]) == 0
    second = capsys.readouterr().out
    # 16 as written; 32 on vLLM >= 0.32 (tiny_models.cpu_block_size: CPU attention takes multiples of 32)
    assert "llama: kept" in second and f"'block_size': {tiny_models.cpu_block_size(16)}" in second
    with pytest.raises(SystemExit) as exc:
        tiny_models.main(["--out", str(tmp_path), "nope"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        tiny_models.main(["--help"])
    assert exc.value.code == 0
    assert "tiny-models" in capsys.readouterr().out


def test_llm_kwargs():
    assert tiny_models.llm_kwargs("llama4", "/m")["block_size"] == 32
    q = tiny_models.llm_kwargs("qwen3next", "/m", max_model_len=128)
    assert q["mamba_ssm_cache_dtype"] == "float32" and q["dtype"] == "bfloat16"
    assert q["max_model_len"] == 128 and q["model"] == q["tokenizer"] == "/m"
    for name in tiny_models.MODEL_NAMES:
        assert tiny_models.llm_kwargs(name, "/m")["enforce_eager"] is True


# ---- the real CPU engine -----------------------------------------------------------------------

@pytest.fixture(scope="module", params=tiny_models.MODEL_NAMES)
def engine(request, tiny_llm):
    with tiny_llm(request.param) as llm:
        yield request.param, llm


def test_engine_kv_cache_layout(engine):
    name, llm = engine
    from vllm.model_executor.models.utils import extract_layer_index

    kv_config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    by_layer = {}
    for group in kv_config.kv_cache_groups:
        for layer in group.layer_names:
            by_layer[extract_layer_index(layer)] = type(group.kv_cache_spec).__name__
    assert [by_layer[i] for i in sorted(by_layer)] == EXPECTED_LAYER_SPECS[name]
    cache = llm.llm_engine.vllm_config.cache_config
    if name == "llama4":
        assert cache.block_size == 32
    if name == "qwen3next":
        assert cache.mamba_ssm_cache_dtype == "float32"


def test_engine_greedy_generation_is_deterministic(engine, greedy):
    name, llm = engine
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    first = greedy(llm, PROMPTS, MAX_TOKENS)
    again = greedy(llm, PROMPTS, MAX_TOKENS)  # may reuse cached prefix blocks
    llm.reset_prefix_cache()
    cold = greedy(llm, PROMPTS, MAX_TOKENS)  # computed from scratch again
    assert [len(t) for t in first] == [MAX_TOKENS] * len(PROMPTS)
    assert all(0 <= t < vocab for ids in first for t in ids)
    assert first == again == cold, f"{name}: greedy tokens changed between runs"
    assert first[0] != first[1], f"{name}: different prompts gave the same completion"
