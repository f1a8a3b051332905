"""Start and stop real `vllm serve` processes (and `lmcache_server`) on loopback for the server tests.

- `Server(name, serve_args, env)`: ``vllm serve *serve_args`` from the repository root, as a user
  would type it (the commands in docs/streaming-usage.md and docs/hybrid-lmcache-usage.md). The
  placeholder ports of those commands (`PORT`, `LMCACHE_PORT`) are replaced by free ports.
  ``start()`` refuses a port that is taken, captures the server's output to
  ``build/server-tests/<name>.log`` and waits for ``/health`` (the log's tail is in the error when it
  does not come up). ``stop()`` ends the whole process tree (its own process
  group). One server per module: see the module-scoped fixtures of the tests.
- `OfflineRun`: the same model through `vllm.LLM` (tests/env/lmcache/engine_run.py) in its own
  process, started next to the server, for the reference tokens.
- `bench_serve(...)`: ``vllm bench serve`` against a server, returning its ``--save-result`` JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent  # the venv the tests run in: its `vllm`, `lmcache_server`
LOG_DIR = ROOT / "build" / "server-tests"
ENGINE_RUN = ROOT / "tests" / "env" / "lmcache" / "engine_run.py"
FAULT_SITE = ROOT / "tests" / "env" / "lmcache" / "fault_site"


def with_fault_site(server: "Server", zero_restored_state: str = "1") -> "Server":
    """Put tests/env/lmcache/fault_site on the server's PYTHONPATH with its zeroing hook armed
    (KVSTACK_ZERO_RESTORED_STATE: "1", or a flag file's path: zeroed while the file exists)."""
    server.env["KVSTACK_ZERO_RESTORED_STATE"] = zero_restored_state
    server.env["PYTHONPATH"] = os.pathsep.join(
        [str(FAULT_SITE), str(ROOT)] + ([server.env["PYTHONPATH"]] if server.env.get("PYTHONPATH") else []))
    return server

# The ports the documented commands use; the tests substitute free ones.
PORT = "8000"
LMCACHE_PORT = "65432"

# The environment of every server command in the docs (the Makefile's, plus the CPU engine's
# speed-ups from kvstack.testbed.tiny_models.ENGINE_ENV, which do not change the tokens).
BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "PYTHONHASHSEED": "0",
    "TORCHDYNAMO_DISABLE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _substitute(items, ports: dict[str, int]):
    out = []
    for item in items:
        for placeholder, port in ports.items():
            item = item.replace(f"127.0.0.1:{placeholder}", f"127.0.0.1:{port}")
        out.append(item)
    return out


try:  # loaded here, not in the forked child (no dlopen between fork and exec)
    import ctypes

    _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except Exception:  # noqa: BLE001 (not glibc: no parent-death signal)
    _PRCTL = None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the test process dies (even by SIGKILL), so a
    killed test run leaves no server behind (Linux prctl PR_SET_PDEATHSIG)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)


def _tree(pid: int):
    import psutil

    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    import psutil

    tree = _tree(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in tree:  # children that left the group
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    keep = [ln for ln in text if "Route:" not in ln]  # skip the route table
    return "\n".join(keep[-lines:])


class Server:
    """One `vllm serve` process tree on 127.0.0.1."""

    def __init__(self, name: str, serve_args: list[str], env: dict[str, str] | None = None,
                 ports: dict[str, int] | None = None, port: int | None = None):
        self.name = name
        self.port = port or free_port()
        self.ports = {PORT: self.port, **(ports or {})}
        args = list(serve_args)
        i = args.index("--port")
        args[i + 1] = str(self.port)
        self.argv = [str(BIN / "vllm"), "serve", *_substitute(args, self.ports)]
        self.model = args[0]
        self.env = {**os.environ, **BASE_ENV,
                    **dict(zip(env or {}, _substitute((env or {}).values(), self.ports)))}
        self.url = f"http://127.0.0.1:{self.port}"
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log = LOG_DIR / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    # ---- life cycle --------------------------------------------------------------------------
    def start(self) -> "Server":
        if port_taken(self.port):
            pytest.fail(f"{self.name}: port {self.port} on 127.0.0.1 is taken; cannot start vllm serve")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        return self

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = self.log.read_text(errors="replace")
                why = (f"port {self.port} is taken" if "Address already in use" in text
                       else f"exited with {self.proc.returncode}")
                pytest.fail(f"vllm serve ({self.name}) {why} before /health answered; "
                            f"log {self.log}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        pytest.fail(f"vllm serve ({self.name}) did not answer /health within {timeout_s:.0f} s; "
                    f"log {self.log}:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _stop_group(self.proc)

    def tail(self, lines: int = 60) -> str:
        return _tail(self.log, lines)

    # ---- talking to it -----------------------------------------------------------------------
    def client(self, timeout_s: float = 300.0):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="EMPTY", max_retries=0,
                             timeout=timeout_s)

    def complete(self, prompt: list[int], max_tokens: int = 8, client=None) -> list[int]:
        """Greedy completion of a token-id prompt; the generated token ids."""
        c = client or self.client()
        r = c.completions.create(model=self.model, prompt=prompt, max_tokens=max_tokens,
                                 temperature=0, extra_body={"return_token_ids": True})
        return list(r.choices[0].token_ids)

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name: value summed over its label sets}."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def wait_metrics(self, ok, timeout_s: float = 10.0) -> dict[str, float]:
        """Poll /metrics until ok(metrics) (stats reach the API server just after the response)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if ok(m) or time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    def rss_bytes(self) -> int:
        """Resident memory of the server's whole process tree (API server + engine core)."""
        import psutil

        total = 0
        for p in _tree(self.proc.pid):
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.memory_info().rss
        return total


@contextlib.contextmanager
def serving(server: Server, timeout_s: float = 240.0):
    server.start()
    try:
        server.wait_ready(timeout_s)
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def lmcache_server(port: int):
    """`lmcache_server 127.0.0.1 PORT` (LMCache's remote backend server) on loopback."""
    if port_taken(port):
        pytest.fail(f"lmcache_server: port {port} on 127.0.0.1 is taken")
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / "lmcache_server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(BIN / "lmcache_server"), "127.0.0.1", str(port)], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
                                preexec_fn=_die_with_parent)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"lmcache_server exited with {proc.returncode}:\n{_tail(log_path)}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"lmcache_server did not listen on {port}:\n{_tail(log_path)}")
                time.sleep(0.2)
        yield proc
    finally:
        _stop_group(proc, grace_s=5)


class OfflineRun:
    """Greedy tokens of `prompts` from `vllm.LLM` in a separate process (engine_run.py), with the
    engine arguments of kvstack.testbed.tiny_models.llm_kwargs plus the given ones, no KV connector."""

    def __init__(self, name: str, model: str, model_dir: str, prompts: list[list[int]], *,
                 max_tokens: int, max_model_len: int, max_num_batched_tokens: int,
                 env: dict | None = None, dtype: str | None = None):
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.name = name
        pfile = LOG_DIR / f"{name}-prompts.json"
        pfile.write_text(json.dumps(prompts))
        self.log = LOG_DIR / f"{name}.log"
        cmd = [sys.executable, str(ENGINE_RUN), "--model", model, "--model-dir", str(model_dir), "--prompts", str(pfile), "--max-tokens", str(max_tokens),
               "--max-model-len", str(max_model_len),
               "--max-num-batched-tokens", str(max_num_batched_tokens)]
        if dtype:
            cmd += ["--dtype", dtype]
        full_env = {**os.environ, **BASE_ENV, **(env or {})}
        full_env.pop("VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE", None)  # upstream defaults
        self._out = open(self.log, "w+")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=self._out,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     preexec_fn=_die_with_parent)

    def result(self, timeout_s: float = 600.0) -> list[list[int]]:
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop_group(self.proc, grace_s=1)
            pytest.fail(f"offline reference {self.name} timed out:\n{_tail(self.log)}")
        self._out.seek(0)
        lines = [ln for ln in self._out.read().splitlines() if ln.startswith("{")]
        if rc != 0 or not lines:
            pytest.fail(f"offline reference {self.name} failed ({rc}):\n{_tail(self.log)}")
        return json.loads(lines[-1])["tokens"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            _stop_group(self.proc, grace_s=1)
        self._out.close()


def bench_serve(server: Server, bench_args: list[str], timeout_s: float = 420.0) -> dict:
    """``vllm bench serve *bench_args`` against `server` (its port replaces the documented one), run
    from the repository root; returns the JSON it saved (``--save-result --result-dir D
    --result-filename F``, both required)."""
    args = list(bench_args)
    args[args.index("--port") + 1] = str(server.port)
    path = ROOT / args[args.index("--result-dir") + 1] / args[args.index("--result-filename") + 1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    out = path.with_suffix(".out")
    with open(out, "w") as f:
        res = subprocess.run([str(BIN / "vllm"), "bench", "serve", *args], cwd=ROOT,
                             env={**os.environ, **BASE_ENV}, stdout=f, stderr=subprocess.STDOUT,
                             timeout=timeout_s)
    if res.returncode != 0 or not path.exists():
        pytest.fail(f"vllm bench serve exited {res.returncode}:\n{_tail(out, 40)}\n"
                    f"server log:\n{server.tail(30)}")
    return json.loads(path.read_text())
