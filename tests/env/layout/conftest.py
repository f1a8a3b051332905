"""The layout ladder's tests run only on a base whose series carries the ladder (base 0.25: the
layout refactor is a backport there). From vLLM 0.27 on the refactor is upstream, so on base 0.32
there is nothing of kvstack's to test here and the whole folder is skipped, saying why."""

from __future__ import annotations

import pytest

from kvstack.release import overlay
from kvstack.release.pins import load_pin


def pytest_collection_modifyitems(config, items):
    pin = load_pin("vllm")
    if overlay.issue_patches(pin.series_dir, "3"):
        return
    skip = pytest.mark.skip(reason=f"base {pin.base} (vLLM {pin.version}) has the layout refactor upstream; "
                                   "the ladder is applied on base 0.25 only")
    for item in items:
        if "/tests/env/layout/" in str(item.fspath):
            item.add_marker(skip)
