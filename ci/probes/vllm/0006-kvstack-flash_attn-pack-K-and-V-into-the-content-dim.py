"""Probe for patches/0.25/vllm/0006-kvstack-flash_attn-pack-K-and-V-into-the-content-dim.patch.

Upstream is "already there" when the release has 2/N (vllm-project/vllm#44455, first released in 0.26.0): the attention backends' caches
are packed `(num_blocks, num_kv_heads, block_size, 2*head_size)`.
Upstream wrote the change in its own form, so the patch conflicts there instead of
reverse-applying; this probe tells the two apart. Its tests: flash_attn"s packed cache.
"""

from pathlib import Path

from _probelib import vllm_packed_kv

# junit classnames of the patch's own tests (its rows in the unit / e2e-cpu suites).
TESTS = ["*test_flash_attn_packed*"]


def probe(tree: Path) -> bool:
    return vllm_packed_kv(tree)
