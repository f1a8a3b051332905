"""Server tests: a failing test gets the tail of its server's log in its report."""

from __future__ import annotations

import pytest

from vllm_server import Server


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and call.when == "call":
        for value in getattr(item, "funcargs", {}).values():
            if isinstance(value, Server):
                rep.sections.append((f"vllm serve log ({value.log}), tail", value.tail()))
