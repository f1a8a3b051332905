"""Probe for patches/0.32/lmcache/0007-kvstack-local-disk-backend-index-chunk-files-left-by.patch
(base 0.25 numbers the same patch 0006: 0006-kvstack-local-disk-backend-index-chunk-files-left-by.py
runs this file, as probes are keyed by patch file name).

Upstream is "already there" when LMCache's LocalDiskBackend finds chunk files written by an
earlier process by itself (LMCache#1175): its class then lists its folder (os.listdir / os.scandir /
glob) or reads a per-chunk metadata sidecar (a ".meta" file name, as LMCache#4778 proposes) --
neither exists in 0.5.3 or 0.5.6, where the index lives only in memory.
"""

import ast
from pathlib import Path

from _probelib import find_class

REL = "lmcache/v1/storage_backend/local_disk_backend.py"

# junit classnames of the patch's own tests (its rows in the unit / e2e-cpu suites).
TESTS = ["*test_disk_index*"]


def probe(tree: Path) -> bool:
    cls = find_class(tree, REL, "LocalDiskBackend")
    if cls is None:
        return False
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and node.attr in ("listdir", "scandir", "glob", "iglob"):
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and ".meta" in node.value:
            return True
    return False
