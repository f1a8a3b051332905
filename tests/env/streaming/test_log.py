"""The connector's log lines reach vLLM's log (kvstack/streaming/log.py): vLLM configures only its
own logger tree, so a logger outside it lost its INFO lines in a server (the host tier's
page-locking, prefix reuse, cache resets, the shared tier) and printed its warnings unformatted.
The user's path (a `vllm serve` log) is checked by test_streaming_admission_server.py's reset
test; here the mechanism, in a fresh process, with the old name as the control."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import kvstack.streaming as streaming

PROBE = r"""
import logging
import vllm.logger
# what start-up does: base 0.25 at vLLM's import, base 0.32 when `vllm serve` or LLM(...)
# applies its LoggingConfig; the same function on both, with the same defaults
vllm.logger._configure_vllm_root_logger()
from kvstack.streaming.log import logger
logger.info("kvstack streaming: probe info")
logger.warning("kvstack streaming: probe warning")
logger.debug("kvstack streaming: probe debug")
old = logging.getLogger("kvstack.streaming")  # the name before: outside vLLM's tree
old.info("kvstack streaming: old-name info")
old.warning("kvstack streaming: old-name warning")
"""
# vLLM's format: "LEVEL mm-dd hh:mm:ss [file.py:line] message"
VLLM_LINE = r"^(?:\(\w+ pid=\d+\) )?{level} \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+\] {msg}$"


def _run(**env) -> str:
    e = {**os.environ, "VLLM_CONFIGURE_LOGGING": "1", "NO_COLOR": "1", **env}
    e.pop("VLLM_LOGGING_CONFIG_PATH", None)
    r = subprocess.run([sys.executable, "-c", PROBE], env=e, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr


def _has(text: str, level: str, msg: str) -> bool:
    pat = VLLM_LINE.format(level=level, msg=re.escape(msg))
    return any(re.match(pat, line) for line in text.splitlines())


def test_lines_go_through_vllms_handler_and_follow_its_level():
    out = _run()
    assert _has(out, "INFO", "kvstack streaming: probe info"), out
    assert _has(out, "WARNING", "kvstack streaming: probe warning"), out
    assert "probe debug" not in out, out  # vLLM's default level: INFO
    # control, the old logger outside vLLM's tree: its INFO line is lost, its warning comes
    # out bare (Python's last-resort handler), not in vLLM's format
    assert "old-name info" not in out, out
    assert "kvstack streaming: old-name warning" in out
    assert not _has(out, "WARNING", "kvstack streaming: old-name warning"), out

    quiet = _run(VLLM_LOGGING_LEVEL="WARNING")  # the user's level applies to ours too
    assert "probe info" not in quiet and _has(quiet, "WARNING", "kvstack streaming: probe warning")


def test_every_streaming_module_logs_through_it():
    root = Path(streaming.__file__).parent
    own = [p.name for p in sorted(root.glob("*.py"))
           if p.name != "log.py" and "logging.getLogger(" in p.read_text()]
    assert own == [], f"modules with a logger of their own (use .log.logger): {own}"
    users = [p.name for p in sorted(root.glob("*.py")) if "logger." in p.read_text()
             and p.name != "log.py"]
    assert {"connector.py", "scheduler_side.py", "worker_side.py", "shared_tier.py"} <= set(users)
    for name in users:
        assert "from .log import logger" in (root / name).read_text(), name
