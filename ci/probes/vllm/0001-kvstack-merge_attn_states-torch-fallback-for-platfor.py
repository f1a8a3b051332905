"""Probe for patches/0.25/vllm/0001-kvstack-merge_attn_states-torch-fallback-for-platfor.patch.

Upstream is "already there" when merge_attn_states() dispatches to a torch merge on the CPU
platform (vllm-project/vllm#51471, first released in 0.29.0): the patch then conflicts in
merge_attn_states.py rather than reverse-applying, because upstream wrote it differently.
"""

from pathlib import Path

from _probelib import vllm_merge_attn_states_cpu

# junit classnames of the patch's own tests (its rows in the unit / e2e-cpu suites).
TESTS = ["*test_merge_attn_states_torch*", "*test_merge_attn_states_fallback*"]


def probe(tree: Path) -> bool:
    return vllm_merge_attn_states_cpu(tree)
