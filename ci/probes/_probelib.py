"""Helpers for the per-patch probes in ci/probes/<component>/<patch>.py.

A probe answers one question about a pristine upstream tree (an unpacked sdist):
"is this patch's change already upstream here, perhaps in another form?". It must be
False on the pinned release (the runner reports an error otherwise) and should read
code structure (ast) or a precise signature of the change, never version numbers.
Import these with `from _probelib import ...` (the runner puts ci/probes on sys.path).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path


def source(tree: Path, rel: str) -> str:
    """The text of tree/rel, or "" when the file does not exist."""
    path = tree / rel
    return path.read_text(errors="replace") if path.is_file() else ""


def find_class(tree: Path, rel: str, name: str) -> ast.ClassDef | None:
    text = source(tree, rel)
    if not text:
        return None
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def class_bases(tree: Path, rel: str, name: str) -> list[str]:
    """The base class names (last dotted part) of class `name` in tree/rel; [] if absent."""
    cls = find_class(tree, rel, name)
    if cls is None:
        return []
    out = []
    for base in cls.bases:
        node = base.value if isinstance(base, ast.Subscript) else base
        out.append(node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", ""))
    return out


def class_defines(tree: Path, rel: str, cls_name: str, method: str) -> bool:
    cls = find_class(tree, rel, cls_name)
    return cls is not None and any(
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == method for n in cls.body)


def mentions(tree: Path, package: str, word: str) -> bool:
    """Whether any .py file under tree/package contains `word`."""
    return any(word in p.read_text(errors="replace") for p in (tree / package).rglob("*.py"))


# --- vLLM KV-cache layout ladder (REFERENCE: 2/N #44455 in 0.26.0, 3/N #44456 in 0.27.0) ---

FLASH_ATTN = "vllm/v1/attention/backends/flash_attn.py"
_PACKED = re.compile(r"num_kv_heads,\s*block_size,\s*2\s*\*\s*head_size")
_SPLIT = re.compile(r"\(\s*num_blocks,\s*2,\s*block_size,\s*num_kv_heads,\s*head_size\s*\)")


def vllm_packed_kv(tree: Path) -> bool:
    """2/N: the flash-attn KV cache is blocks-first, head-major, K and V packed in the content dim."""
    text = source(tree, FLASH_ATTN)
    return bool(_PACKED.search(text)) and not _SPLIT.search(text)


def vllm_bind_kv_cache(tree: Path) -> bool:
    """3/N: AttentionLayerBase.bind_kv_cache exists and TransferTopology.get_transfer_cache_regions is gone."""
    base = "vllm/model_executor/layers/attention_layer_base.py"
    return class_defines(tree, base, "AttentionLayerBase", "bind_kv_cache") and not mentions(
        tree, "vllm", "get_transfer_cache_regions")


def vllm_layout_api(tree: Path) -> bool:
    """4/N (#51718): the KVCacheLayout descriptor and the backends' supported_kv_cache_layouts()."""
    return find_class(tree, "vllm/v1/kv_cache_layout.py", "KVCacheLayout") is not None and class_defines(
        tree, "vllm/v1/attention/backend.py", "AttentionBackend", "supported_kv_cache_layouts")


# --- hybrid models with LMCache (REFERENCE: vLLM #42620 open; LMCache #3284 closed unmerged) ---

LMCACHE_CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py"


def vllm_lmcache_connector_hma(tree: Path) -> bool:
    """vLLM #42620: LMCacheConnectorV1 declares SupportsHMA."""
    return "SupportsHMA" in class_bases(tree, LMCACHE_CONNECTOR, "LMCacheConnectorV1")


def function_branches_on(tree: Path, rel: str, func: str, attr: str) -> bool:
    """Whether function `func` in tree/rel has an if/elif whose test calls `<something>.<attr>()`."""
    text = source(tree, rel)
    if not text:
        return False
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == func:
            for branch in ast.walk(node):
                if isinstance(branch, ast.If):
                    for call in ast.walk(branch.test):
                        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                                and call.func.attr == attr):
                            return True
    return False


# --- merge_attn_states on CPU (REFERENCE-style fact from the patch: vllm-project/vllm#51471, in 0.29.0) ---


def vllm_merge_attn_states_cpu(tree: Path) -> bool:
    """merge_attn_states() has a CPU branch (upstream's inline torch merge for current_platform.is_cpu())."""
    return function_branches_on(tree, "vllm/v1/attention/ops/merge_attn_states.py", "merge_attn_states", "is_cpu")
