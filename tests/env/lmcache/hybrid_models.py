"""A tiny Qwen3-Next whose gated delta-net (GDN) state matters, for restore tests with a negative
control: the recipe lives in kvstack.testbed.long_memory (the demo uses it too); the tests import it
from here.

The random tiny Qwen3-Next (kvstack.testbed.tiny_models) forgets its recurrent state within a token,
so restoring a zeroed state gives the same greedy tokens as restoring the right one; a test built on
it could not fail. `long_memory_qwen3next` copies it with a slow decay and scaled GDN weights, so the
state carries the prefix and a wrong or zeroed state changes the output.
"""

from __future__ import annotations

from kvstack.testbed.long_memory import long_memory_qwen3next  # noqa: F401
