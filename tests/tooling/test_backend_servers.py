"""kvstack.testbed.backend_servers: a server a test starts ends with the process that started it,
even when that process is killed outright (SIGKILL: no `finally` runs), so a killed test run leaves
no server holding memory and ports (an LMCache MP server holds 1.3 GB). The control: the same
server started without the parent-death signal outlives its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PARENT = r"""
import subprocess, sys, time
from pathlib import Path
from kvstack.testbed import backend_servers as bs
port = bs.free_port()
cmd = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]
if sys.argv[1] == "running":
    ctx = bs.running(cmd, port, Path(sys.argv[2]), what="http.server")
    proc = ctx.__enter__()
else:  # the control: the same start without the parent-death signal
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    bs.wait_port(port, proc, "http.server")
print(proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (its parent gone, not yet reaped by init) counts as ended
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _server_of_killed_parent(how: str, tmp_path) -> int:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, how, str(tmp_path / "server.log")],
                              cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    pid = int(parent.stdout.readline())
    assert _alive(pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pid


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_server_ends_with_the_killed_process_that_started_it(tmp_path):
    pid = _server_of_killed_parent("running", tmp_path)
    assert not _alive(pid), "the server outlived the process that started it"


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_control_without_the_signal_the_server_outlives_it(tmp_path):
    pid = _server_of_killed_parent("plain", tmp_path)
    try:
        assert _alive(pid), "the control's server ended too: the test above could not fail"
    finally:
        os.killpg(pid, signal.SIGKILL)
