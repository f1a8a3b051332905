"""Real LMCache backend servers on 127.0.0.1 for tests: `lmcache_server` (LMCache's own, from the
venv's bin) and `redis-server` (Debian's package, installed with apt-get when missing and running
as root, as in CI). Each is started in its own process group, so a test can kill it mid-run
(``os.killpg(server.pid, SIGKILL)``) and always stop it (`stop`); and it ends with the process that
started it (SIGTERM on the parent's death), so a killed test run leaves no server behind.

`running(cmd, port, log, env)` starts any server command the same way (its output in `log`, whose
tail is in the error when it does not come up) and stops it on exit: bench/hybrid_repeat.py and
tests/env/lmcache/test_mp_route.py (LMCache's MP server) use it.

Used by tests/env/lmcache/test_shared_backend.py and tests/env/streaming/test_shared_tier.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

BACKENDS = ("lmcache_server", "redis")


class ServerUnavailable(RuntimeError):
    """The server's program is not installed and cannot be installed here."""


def _dies_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the process that started it ends, so a
    test run killed outright (no `finally` runs) leaves no server holding memory and ports."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the `finally` blocks stop the servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20.0,
              log: Path | None = None) -> None:
    """Until `proc` listens on 127.0.0.1:`port`; a RuntimeError (with the tail of `log`) when it
    exits first or does not listen within `timeout` s."""
    tail = (lambda: ":\n" + log.read_text(errors="replace")[-4000:]) if log else (lambda: "")
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening{tail()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port}{tail()}")


@contextmanager
def running(cmd: list[str], port: int, log: Path, env: dict | None = None,
            timeout: float = 120.0, what: str = "server"):
    """Run server command `cmd` (output to `log`, its own process group) until it listens on
    `port`; yield its process; on exit SIGTERM the group (SIGKILL after 10 s)."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=_dies_with_parent)
    try:
        wait_port(port, proc, what, timeout, log)
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def lmcache_mp_server_cmd(port: int, chunk: int) -> list[str]:
    """LMCache's multi-process server on 127.0.0.1 (docs/hybrid-lmcache.md's command):
    `--l1-size-gb` and `--eviction-policy` are required on LMCache 0.5.3 and 0.5.6; `auto` lets a CPU
    worker take the engine-driven transfer; `--disable-observability`: no Prometheus port on
    0.0.0.0."""
    return [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
            "--port", str(port), "--chunk-size", str(chunk), "--l1-size-gb", "1",
            "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
            "--disable-observability"]


def redis_server() -> str:
    """Debian's redis-server, installed with apt-get when missing and running as root; raises
    ServerUnavailable when it cannot be had."""
    exe = shutil.which("redis-server")
    if exe is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "--no-install-recommends", "redis-server"]
        if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True)
            subprocess.run(cmd, env=env, capture_output=True)
        exe = shutil.which("redis-server")
    if exe is None:
        raise ServerUnavailable("redis-server is not installed (Debian package redis-server)")
    return exe


def start(backend: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    """(server process, LMCache remote_url) for `backend` ("lmcache_server" or "redis")
    listening on 127.0.0.1 only, in a new process group."""
    port = free_port()
    if backend == "lmcache_server":
        cmd = [str(Path(sys.executable).with_name("lmcache_server")), "127.0.0.1", str(port)]
        url = f"lm://127.0.0.1:{port}"
    elif backend == "redis":
        exe = redis_server()
        cmd = [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
               "--dir", str(workdir)]
        url = f"redis://127.0.0.1:{port}"
    else:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=_dies_with_parent)
    try:
        wait_port(port, proc, backend)
    except Exception:
        stop(proc)
        raise
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    """Kill the server's process group (if still running) and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def start_or_skip(backend: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    """`start` for pytest: a server that cannot be had skips the test, except under CI (fails)."""
    import pytest

    try:
        return start(backend, workdir)
    except ServerUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(str(e))
        pytest.skip(str(e))
