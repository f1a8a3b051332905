"""Probe for patches/0.25/lmcache/0006-kvstack-local-disk-backend-index-chunk-files-left-by.patch:
the same patch as base 0.32's 0007, so the same probe (probes are keyed by patch file name; the
check itself is 0007-kvstack-local-disk-backend-index-chunk-files-left-by.py)."""

import runpy
from pathlib import Path

_SAME = runpy.run_path(str(Path(__file__).with_name(
    "0007-kvstack-local-disk-backend-index-chunk-files-left-by.py")))
probe = _SAME["probe"]
TESTS = _SAME["TESTS"]
