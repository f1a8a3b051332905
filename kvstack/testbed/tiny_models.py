"""Tiny random-weight models, made locally, for tests and the demo.

No checkpoint can be downloaded on the machines kvstack is tested on, so the models the CPU
engine runs are written here: a `transformers` config, random weights from a fixed seed saved with
`save_pretrained(safe_serialization=True)`, and a byte-level BPE tokenizer trained with the
`tokenizers` package on a short built-in text. The same call writes the same bytes.

Four models (MODEL_NAMES), each small enough to load and generate in a few seconds on two CPU cores:

- ``llama``: LlamaForCausalLM, the plain full-attention case.
- ``llama4``: Llama4ForCausalLM text-only with iRoPE: layers 0-2 use chunked local attention
  (chunk 32), layer 3 is a NoPE global layer; two experts.
- ``qwen3next``: Qwen3NextForCausalLM, hybrid gated delta-net (linear attention) + full attention.
- ``gemma2``: Gemma2ForCausalLM, sliding window (64) and full attention alternating.

Made on request only (in MODELS, not in MODEL_NAMES: not written by default, nor run by the demo or
tests/env/test_tiny_models.py):

- ``deepseek_v2``: DeepseekV2ForCausalLM, MLA: a 576-wide latent KV cache with one "head" per
  token (kv_lora_rank 512 + rope 64, the one size vLLM 0.32's CPU MLA kernels take), 2 dense
  layers; for the MLA tests (tests/env/lmcache/test_mla_lmcache.py) and the family table
  (kvstack.testbed.family_table). vLLM 0.25.1's CPU engine refuses MLA models.
- ``gemma3``: Gemma3ForCausalLM text-only, 5 sliding-window layers : 1 global (the family table).
- ``gpt_oss``: GptOssForCausalLM, sliding window + full attention with sinks, 2 experts (to
  reproduce what docs/family-table.md says of gpt-oss with LMCache on the CPU engine).

`llm_kwargs(name, model_dir)` gives the vLLM ``LLM(...)`` arguments each model needs on the CPU
engine, so tests and the demo start engines the same way.

    kvstack tiny-models --out build/tiny-models [llama llama4 qwen3next gemma2 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

MODEL_NAMES = ("llama", "llama4", "qwen3next", "gemma2")
DEFAULT_OUT = Path("build") / "tiny-models"
SEED = 1234
VOCAB_SIZE = 1024
# Special tokens take the first ids; the model configs point at them.
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
TOKENIZER_VOCAB = 640  # trained vocabulary (bytes + merges + specials); must stay <= VOCAB_SIZE
STAMP = ".kvstack-tiny-model.json"
# Bump when the way a model is written changes, so cached models are rebuilt.
GENERATOR_VERSION = 1

# Environment the CPU engine needs; applied only where the user has not set a value.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; without it vLLM reserves most of the RAM
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine core: starts in seconds
    "HF_HUB_OFFLINE": "1",  # never reach for the hub
    "TOKENIZERS_PARALLELISM": "false",
    # The CPU sampler wraps one function in torch.compile; compiling it (inductor, C++) costs
    # 15-40 s per process here, more than the rest of the engine start. Eager gives the same tokens.
    "TORCHDYNAMO_DISABLE": "1",
}

# Text the tokenizer is trained on (written for kvstack; any text with varied words would do).
CORPUS = """\
A language model reads a prompt one token at a time and keeps, for every layer, the keys and
values it has already computed. That store is the KV cache. When the next token is generated the
model only computes a new query, key and value for that token and attends over everything kept so
far, which is why generation is fast after the first pass over the prompt.
The cache grows with the context. A long document, a long chat or a large code base can make it
larger than the memory of the device, and then something has to give: the cache can be paged out
to host memory, compressed, shared between requests that start with the same words, or dropped
for layers that only look at a local window.
Some models mix layer kinds. A local layer attends over a fixed chunk of recent tokens, a global
layer attends over the whole history, and a linear layer keeps a small recurrent state instead of
keys and values. Each kind needs a different cache: blocks for attention, a state per request for
the recurrent layers, and the engine has to page, save and restore all of them together.
Blocks are the unit of the paged cache. A request owns a list of block ids, the scheduler gives out
free blocks as the sequence grows, and a block whose tokens match an earlier prompt can be reused
by hashing its contents together with the hash of the block before it.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Sphinx of black quartz, judge my vow. How vexingly quick daft zebras jump!
Numbers and symbols appear too: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096,
x = y + z; f(a, b) -> c; [1, 2, 3]; {"key": "value"}; a/b/c.txt; 3.14 2.71 1e-5 100%.
Tests should be small, fast and honest: run the real engine on a real model, compare the tokens it
makes with the tokens it made before, and fail loudly when anything differs.
"""
DEMO_PROMPT = "The KV cache keeps the keys and values of every layer so that"


@dataclass(frozen=True)
class TinyModel:
    """How one tiny model is written and how the CPU engine must run it."""

    name: str
    architecture: str
    config_class: str  # a class name in `transformers`
    config: dict[str, Any]
    engine: dict[str, Any] = field(default_factory=dict)  # extra LLM(...) kwargs
    summary: str = ""


_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
)

MODELS: dict[str, TinyModel] = {
    "llama": TinyModel(
        name="llama",
        architecture="LlamaForCausalLM",
        config_class="LlamaConfig",
        config=dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
        ),
        engine=dict(block_size=16, dtype="bfloat16"),
        summary="Llama, 2 layers, hidden 64, 4 heads / 2 KV heads, head_dim 32",
    ),
    "llama4": TinyModel(
        name="llama4",
        architecture="Llama4ForCausalLM",
        config_class="Llama4TextConfig",
        config=dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=64,  # per expert
            intermediate_size_mlp=128,  # dense MLP (unused when every layer is MoE)
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_local_experts=2,
            num_experts_per_tok=1,
            interleave_moe_layer_step=1,
            no_rope_layers=[1, 1, 1, 0],  # layer 3: NoPE global attention
            attention_chunk_size=32,  # layers 0-2: chunked local attention
            use_qk_norm=True,
        ),
        # vLLM's chunked local attention needs the chunk to be a multiple of the block size.
        engine=dict(block_size=32, dtype="bfloat16"),
        summary="Llama-4 text (iRoPE), 4 layers: 3 chunked-local (chunk 32) + 1 NoPE global, 2 experts",
    ),
    "qwen3next": TinyModel(
        name="qwen3next",
        architecture="Qwen3NextForCausalLM",
        config_class="Qwen3NextConfig",
        config=dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            # 64: vLLM 0.32's CPU gated delta-net kernel takes no smaller head (0.25's takes 32 too).
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
        ),
        # The CPU gated delta-net kernels need bf16 activations and a float32 recurrent state.
        engine=dict(dtype="bfloat16", mamba_ssm_cache_dtype="float32"),
        summary="Qwen3-Next hybrid, 4 layers: 3 gated delta-net (linear attention) + 1 full attention",
    ),
    "gemma2": TinyModel(
        name="gemma2",
        architecture="Gemma2ForCausalLM",
        config_class="Gemma2Config",
        config=dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,  # vLLM's Gemma-2 has no separate lm_head
            query_pre_attn_scalar=32,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        engine=dict(block_size=32, dtype="bfloat16"),
        summary="Gemma-2, 4 layers: sliding window 64 and full attention alternating, soft-capped",
    ),
    # Not in MODEL_NAMES (only the MLA tests make it): vLLM 0.25.1's CPU engine refuses MLA, and
    # vLLM 0.32's CPU MLA kernels take one latent size only, 576 = kv_lora_rank 512 + rope 64.
    "deepseek_v2": TinyModel(
        name="deepseek_v2",
        architecture="DeepseekV2ForCausalLM",
        config_class="DeepseekV2Config",
        config=dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,  # plain q_proj, as DeepSeek-V2-Lite
            kv_lora_rank=512,  # latent cache 512 + 64 = 576 wide, one "head" per token
            qk_rope_head_dim=64,
            # 32, not 16: on an AMX CPU vLLM picks its AMX_MLA backend, whose weight packing
            # refuses 16 input features ("invalid weight input features 16") at start-up
            qk_nope_head_dim=32,
            v_head_dim=32,
            first_k_dense_replace=2,  # every layer dense: no MoE
            n_routed_experts=2,
            n_shared_experts=1,
            moe_intermediate_size=64,
            num_experts_per_tok=1,
            # Weights drawn with std 0.3, not 0.02: with 0.02 this model's next-token logprobs
            # lie within hundredths of each other (greedy tokens on exact ties) and its attention
            # is nearly uniform, so a wrong latent KV would hardly change a token.
            initializer_range=0.3,
        ),
        engine=dict(dtype="bfloat16"),  # block size: vLLM's CPU platform sets it for MLA (16; AMX: 128)
        summary="DeepSeek-V2 (MLA), 2 dense layers: 576-wide latent KV (kv_lora_rank 512 + rope 64)",
    ),
    # Not in MODEL_NAMES either: Gemma-3 is a family of the family table (kvstack.testbed.family_table);
    # gpt-oss is not (docs/family-table.md says why: with LMCache its CPU output varies run to run,
    # on stock too), it is here to reproduce that.
    "gemma3": TinyModel(
        name="gemma3",
        architecture="Gemma3ForCausalLM",
        config_class="Gemma3TextConfig",
        config=dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            query_pre_attn_scalar=32,
            sliding_window=64,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],  # Gemma-3's 5 local : 1 global
        ),
        engine=dict(block_size=32, dtype="bfloat16"),
        summary="Gemma-3 text, 6 layers: 5 sliding-window (64) : 1 global, QK-norm",
    ),
    # Not in MODEL_NAMES: families of the family table (kvstack.testbed.family_table). Qwen3-MoE:
    # plain full attention with MoE MLPs (Llama-4's MoE comes with chunked-local attention).
    "qwen3_moe": TinyModel(
        name="qwen3_moe",
        architecture="Qwen3MoeForCausalLM",
        config_class="Qwen3MoeConfig",
        config=dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        ),
        engine=dict(block_size=16, dtype="bfloat16"),
        summary="Qwen3-MoE, 2 layers: full attention (4 heads / 2 KV heads) + 4 experts, top 2",
    ),
    # Granite-4: Mamba2 layers (conv + SSM state per layer) where Qwen3-Next has gated delta-net ones.
    "granite4": TinyModel(
        name="granite4",
        architecture="GraniteMoeHybridForCausalLM",
        config_class="GraniteMoeHybridConfig",
        config=dict(
            _COMMON,
            hidden_size=128,  # vLLM's Granite attention takes head_dim = hidden / heads: 32
            intermediate_size=64,  # per expert
            shared_intermediate_size=64,
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=2,
            num_experts_per_tok=1,
            mamba_n_heads=8,
            mamba_d_head=32,  # mamba_expand 2 x hidden 128 = 8 heads x 32
            mamba_expand=2,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=64,
            position_embedding_type="rope",
        ),
        engine=dict(dtype="bfloat16", mamba_ssm_cache_dtype="float32"),
        summary="Granite-4 hybrid (Mamba2 + attention), 4 layers: 3 Mamba2 + 1 full attention, 2 experts",
    ),
    "gpt_oss": TinyModel(
        name="gpt_oss",
        architecture="GptOssForCausalLM",
        config_class="GptOssConfig",
        config=dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_local_experts=2,
            num_experts_per_tok=1,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention"],  # alternating, with sinks
        ),
        engine=dict(block_size=32, dtype="bfloat16"),
        summary="gpt-oss, 2 layers: sliding window (64) and full attention with sinks, 2 experts",
    ),
}


def llm_kwargs(name: str, model_dir: str | os.PathLike[str], **overrides: Any) -> dict[str, Any]:
    """The vLLM `LLM(...)` keyword arguments that run tiny model `name` on the CPU engine."""
    spec = _spec(name)
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        tokenizer=str(model_dir),
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        enforce_eager=True,  # no graph capture or torch.compile: starts in seconds on CPU
        seed=0,
    )
    kwargs.update(spec.engine)
    kwargs.update(overrides)
    if "block_size" in kwargs:
        kwargs["block_size"] = cpu_block_size(kwargs["block_size"])
    return kwargs


def cpu_block_size(block_size: int | None) -> int | None:
    """Version switch (vLLM >= 0.32): the CPU attention backend takes block sizes that are
    multiples of 32 only ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"), so a
    smaller one is rounded up there; on 0.25 every size is kept as written."""
    if block_size is None or block_size % 32 == 0:
        return block_size
    try:
        import vllm
    except ImportError:
        return block_size
    if not hasattr(vllm, "__version__"):  # a namespace package (the checkout's vllm/ of pins): no vLLM
        return block_size
    major_minor = tuple(int(x) for x in vllm.__version__.split(".")[:2])
    return -(-block_size // 32) * 32 if major_minor >= (0, 32) else block_size


def cpu_exactness_dtype() -> str | None:
    """The dtype in which a streaming-vs-native *exactness* comparison runs on the CPU engine:
    "float16" where vLLM's CPU attention would run bf16 on its AMX kernel (an AMX CPU), else None
    (the model's bf16).

    Measured on an AMX host (Sapphire Rapids, vLLM 0.32.0): with bf16, native runs of other batch
    compositions and the streaming paths differ by up to 0.06 nats in the top-5 logprobs and flip
    greedy tokens at exact ties (AMX tile accumulation order), beyond the 0.03 tolerance those
    comparisons hold; in float16 vLLM runs its vec kernel and they are within 0.03 as on CPUs
    without AMX, negative controls included. The AMX kernel itself still serves every other
    streaming test (greedy tokens equal to native).
    """
    try:
        import torch

        return "float16" if torch.cpu._is_amx_tile_supported() else None
    except Exception:
        return None


def engine_crash_reason(name: str) -> str | None:
    """Why vLLM's CPU engine cannot run tiny model `name` on this host, or None when it can.

    Known case: vLLM 0.25.1's CPU gated-delta-net prefill kernel (``chunk_gated_delta_rule_cpu``,
    compiled code) executes an AMX tile instruction (``tilezero``) without a tile configuration and
    dies with SIGILL on AMX CPUs (Sapphire Rapids and later), with or without any connector; vLLM
    0.32.0's kernel runs the same model. So Qwen3-Next-style models need base 0.32 on such CPUs.
    """
    if name != "qwen3next":
        return None
    try:
        import torch
        import vllm
    except ImportError:
        return None
    if not hasattr(vllm, "__version__"):  # a namespace package (the checkout's vllm/ of pins): no vLLM
        return None
    major_minor = tuple(int(x) for x in vllm.__version__.split(".")[:2])
    if major_minor >= (0, 32):
        return None
    try:
        amx = bool(torch.cpu._is_amx_tile_supported())
    except Exception:
        amx = False
    if not amx:
        return None
    return (f"vLLM {vllm.__version__}'s CPU gated-delta-net kernel (chunk_gated_delta_rule_cpu) dies "
            "with SIGILL (an AMX tilezero without a tile configuration) on this AMX CPU; "
            "Qwen3-Next-style models need base 0.32 here")


def apply_engine_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set the CPU engine's environment variables where they are unset; return what was set."""
    environ = os.environ if environ is None else environ
    added = {}
    for key, value in ENGINE_ENV.items():
        if key not in environ:
            environ[key] = value
            added[key] = value
    return added


def apply_gpu_env(model: str | None = None, environ: dict[str, str] | None = None) -> dict:
    """On a GPU machine without FlashInfer (ci/gpu/carry.py leaves it out), what vLLM 0.25.1
    needs to start: its sampler imports FlashInfer unless VLLM_USE_FLASHINFER_SAMPLER=0 (set here
    where unset). Returns the engine keyword arguments the model also needs: Qwen3-Next's GDN
    prefill in Triton rather than FlashInfer's kernel. Nothing when FlashInfer is installed."""
    import importlib.util

    environ = os.environ if environ is None else environ
    if importlib.util.find_spec("flashinfer") is not None:
        return {}
    environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if model is not None and "Qwen3Next" in _spec(model).architecture:  # GDN layers
        return {"additional_config": {"gdn_prefill_backend": "triton"}}
    return {}


def _spec(name: str) -> TinyModel:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {', '.join(MODELS)}") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def spec_digest(name: str) -> str:
    """A digest of everything that decides the bytes of model `name`."""
    from importlib.metadata import version

    spec = _spec(name)
    recipe = {
        "generator": GENERATOR_VERSION,
        "name": spec.name,
        "architecture": spec.architecture,
        "config_class": spec.config_class,
        "config": spec.config,
        "seed": SEED,
        "corpus": hashlib.sha256(CORPUS.encode()).hexdigest(),
        "tokenizer_vocab": TOKENIZER_VOCAB,
        # Versions from package metadata: checking a cached model must not import torch.
        "versions": [version(p) for p in ("transformers", "tokenizers", "torch", "safetensors")],
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def is_current(name: str, dest: str | os.PathLike[str]) -> bool:
    """True when `dest` already holds exactly the model this module would write for `name`."""
    dest = Path(dest)
    try:
        stamp = json.loads((dest / STAMP).read_text())
    except (OSError, ValueError):
        return False
    if stamp.get("name") != name or stamp.get("spec") != spec_digest(name):
        return False
    files = stamp.get("files") or {}
    on_disk = sorted(p.name for p in dest.iterdir() if p.is_file() and p.name != STAMP)
    if sorted(files) != on_disk:
        return False
    return all(_sha256(dest / f) == digest for f, digest in files.items())


def train_tokenizer(dest: Path) -> None:
    """Train a byte-level BPE tokenizer on CORPUS and save it as a fast tokenizer in `dest`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        min_frequency=1,
        special_tokens=[BOS, EOS, PAD],  # ids 0, 1, 2 in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown tokens
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    ids = [tok.token_to_id(t) for t in (BOS, EOS, PAD)]
    if ids != [BOS_ID, EOS_ID, PAD_ID]:
        raise RuntimeError(f"special token ids came out as {ids}, expected {[BOS_ID, EOS_ID, PAD_ID]}")
    if tok.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"tokenizer vocabulary {tok.get_vocab_size()} exceeds the model's {VOCAB_SIZE}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=4096
    )
    fast.save_pretrained(str(dest))


def _write_model(spec: TinyModel, dest: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, spec.config_class)(**spec.config)
    config.architectures = [spec.architecture]
    # Initialise in float32 from a fixed seed (same numbers on every machine), store as bf16.
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if type(model).__name__ != spec.architecture:
        raise RuntimeError(f"{spec.name}: transformers built {type(model).__name__}, not {spec.architecture}")
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard progress bar is noise
    try:
        model.save_pretrained(str(dest), safe_serialization=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    train_tokenizer(dest)


@contextlib.contextmanager
def writer_lock(dest: Path):
    """One writer of folder `dest` at a time across processes (pytest-xdist workers, concurrent
    sessions): an exclusive lock on `.<name>.lock` beside it, held while it is written."""
    import fcntl

    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def make_model(name: str, dest: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Write tiny model `name` into folder `dest` and return it; keep `dest` if it already holds it.

    `dest` is replaced as a whole (written beside it, then renamed), so a reader never sees half a
    model; writers take turns (`writer_lock`), so a model another process has just written is kept,
    not replaced under its readers. A non-empty `dest` that is not a tiny model written here is
    refused, never deleted.
    """
    spec = _spec(name)
    dest = Path(dest).absolute()
    if not force and is_current(name, dest):
        return dest
    with writer_lock(dest):
        if not force and is_current(name, dest):
            return dest
        return _make_model(name, spec, dest)


def _make_model(name: str, spec: TinyModel, dest: Path) -> Path:
    if dest.exists() and any(dest.iterdir()) and not (dest / STAMP).exists():
        raise FileExistsError(f"{dest} is not empty and holds no kvstack tiny model; not overwriting it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        _write_model(spec, tmp)
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        stamp = {"name": name, "spec": spec_digest(name), "files": files}
        (tmp / STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the model is meant to be shared
        for p in tmp.iterdir():
            p.chmod(0o644)
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old.", dir=dest.parent))
            with contextlib.suppress(FileNotFoundError):  # another writer may have moved it
                os.replace(dest, old / "model")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, dest)
        except OSError:
            # Another process wrote the same model there in the meantime: keep theirs.
            if not is_current(name, dest):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def make_models(out: str | os.PathLike[str], names: list[str] | tuple[str, ...] = MODEL_NAMES,
                *, force: bool = False, report: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Write each named model into OUT/NAME; return name -> folder."""
    written = {}
    for name in names:
        dest = Path(out) / name
        kept = not force and is_current(name, dest)
        written[name] = make_model(name, dest, force=force)
        if report:
            files = sorted(p for p in written[name].iterdir() if p.is_file())
            size = sum(p.stat().st_size for p in files)
            what = "kept (already up to date)" if kept else "wrote"
            report(f"{name}: {what} {written[name]} ({len(files)} files, {size / 1024:.0f} KiB) "
                   f"- {MODELS[name].summary}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvstack tiny-models",
        description="Write the tiny random-weight test models (config, bf16 safetensors, trained BPE "
                    "tokenizer) into OUT/NAME. Deterministic: the same call writes the same bytes; "
                    "a folder that already holds the same model is kept.",
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"models to write (default: "
                        f"{', '.join(MODEL_NAMES)}; also: "
                        f"{', '.join(n for n in MODELS if n not in MODEL_NAMES)})")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="parent folder (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="rewrite even if up to date")
    parser.add_argument("--print-engine-args", action="store_true",
                        help="also print the vLLM LLM(...) arguments for each model")
    args = parser.parse_args(argv)
    names = args.names or list(MODEL_NAMES)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    written = make_models(args.out, names, force=args.force, report=print)
    if args.print_engine_args:
        for name, path in written.items():
            print(f"{name}: LLM(**{llm_kwargs(name, path)!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
