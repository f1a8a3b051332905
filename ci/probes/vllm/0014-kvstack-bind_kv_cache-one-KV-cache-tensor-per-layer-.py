"""Probe for patches/0.25/vllm/0014-kvstack-bind_kv_cache-one-KV-cache-tensor-per-layer-.patch.

Upstream is "already there" when the release has 3/N (vllm-project/vllm#44456, first released in 0.27.0): `AttentionLayerBase.bind_kv_cache`
and no `get_transfer_cache_regions`.
Upstream wrote the change in its own form, so the patch conflicts there instead of
reverse-applying; this probe tells the two apart. Its tests: bind_kv_cache.
"""

from pathlib import Path

from _probelib import vllm_bind_kv_cache

# junit classnames of the patch's own tests (its rows in the unit / e2e-cpu suites).
TESTS = ["*test_bind_kv_cache*", "*test_gpu_check_script*"]


def probe(tree: Path) -> bool:
    return vllm_bind_kv_cache(tree)
