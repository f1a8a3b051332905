"""Hybrid models across engine processes that share nothing but an LMCache backend (issue 16).

The K/V of a prefix and the hybrid (GDN) state at the same position both live in LMCache's
storage, so a second engine *process* that shares only the backend restores both. Each backend is
a real server on 127.0.0.1 that the test starts and stops: `lmcache_server` (LMCache's own) and
`redis-server` (Debian's package, installed by the test when missing). Engine A computes a prompt
and exits; engine B, a new process with no local tier, restores K/V + state from the server and gives the
tokens of a run without any connector; engine C loses the server mid-run (the server's process
group is killed between its two prompts) and must recompute with the same tokens and a warning.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

from test_e2e_cpu import PROMPT_A, PROMPT_EXT, qwen_baseline, qwen_model, run_engine, tiny  # noqa: E402,F401


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, what: str) -> None:
    for _ in range(200):
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited with {proc.returncode} before listening")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{what} did not listen on 127.0.0.1:{port}")


def _redis_server() -> str:
    """Debian's redis-server, installed with apt-get when missing and running as root (as in
    CI); elsewhere the test skips, except under CI, where it fails."""
    exe = shutil.which("redis-server")
    if exe is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "--no-install-recommends", "redis-server"]
        if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True)
            subprocess.run(cmd, env=env, capture_output=True)
        exe = shutil.which("redis-server")
    if exe is None:
        msg = "redis-server is not installed (Debian package redis-server)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return exe


def _start(backend: str, tmp_path: Path):
    """(server process, LMCACHE_REMOTE_URL) for a backend listening on 127.0.0.1 only."""
    port = _free_port()
    if backend == "lmcache_server":
        cmd = [str(Path(sys.executable).with_name("lmcache_server")), "127.0.0.1", str(port)]
        url = f"lm://127.0.0.1:{port}"
    else:
        exe = _redis_server()
        cmd = [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
               "--dir", str(tmp_path)]
        url = f"redis://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    _wait_port(port, proc, backend)
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.parametrize("backend", ["lmcache_server", "redis"])
def test_second_engine_process_restores_kv_and_state_from_the_backend(backend, qwen_model, tmp_path,
                                                                       qwen_baseline):
    model = qwen_model  # the long-memory GDN copy (hybrid_models.py): a wrong state shows
    server, url = _start(backend, tmp_path)
    try:
        # No local tier in any engine: what a later process finds can only come from the server.
        remote = {"LMCACHE_LOCAL_CPU": "False", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.5",
                  "LMCACHE_REMOTE_URL": url, "LMCACHE_REMOTE_SERDE": "naive"}
        a = run_engine(model, "qwen3next", [PROMPT_A], tmp_path / "a", lmcache=True, env=remote)
        assert a["hits"] == [0] and a["tokens"] == [qwen_baseline["A"]]

        # B: a new process; its engine KV is wiped before each prompt, so every hit is a load.
        b = run_engine(model, "qwen3next", [PROMPT_A, PROMPT_EXT], tmp_path / "b", lmcache=True,
                       wipe=True, env=remote)
        assert b["hits"] == [64, 64] and b["restored"] == [64, 64], b
        assert b["tokens"] == [qwen_baseline["A"], qwen_baseline["EXT"]]

        # C: the server dies between its two prompts: the second is recomputed, same tokens.
        c = run_engine(model, "qwen3next", [PROMPT_A, PROMPT_EXT], tmp_path / "c", lmcache=True,
                       wipe=True, env=remote, extra_args=["--kill-pgid", str(server.pid)])
        assert server.wait(timeout=30) is not None
        assert c["restored"][0] == 64 and c["restored"][1] == 0, c
        assert c["tokens"] == [qwen_baseline["A"], qwen_baseline["EXT"]]
        assert c["warnings"], "expected a warning about the lost LMCache backend"
    finally:
        _stop(server)
