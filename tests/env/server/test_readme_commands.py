"""The server examples of README.md are exactly the commands the server tests run: every
``vllm serve`` / ``vllm bench serve`` / ``lmcache_server`` line of the sections "Streaming
attention ..." and "Hybrid models with LMCache ..." (with the ``export`` lines before it in the same
code block) equals the arguments and environment of tests/env/server, and every server the tests
start is shown there. Also: a taken port fails with a clear message before anything starts.
Runs in a second, no server needed."""

from __future__ import annotations

import re
import shlex

import pytest

import test_lmcache_server as lm
import test_streaming_parallel_server as par
import test_streaming_server as st
import test_streaming_lmcache_server as with_lmcache
import test_streaming_shared_tier_server as shared
from vllm_server import BASE_ENV, ROOT

pytestmark = pytest.mark.env

SECTIONS = {"streaming": "## Streaming attention", "hybrid": "## Hybrid models with LMCache"}


def section(title_prefix: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n" + title_prefix)
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def commands(text: str) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, env exported before it in the same block) of each server-related command line of
    the bash blocks of `text`."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        if "vllm serve" not in block and "lmcache_server" not in block:
            continue
        env: dict[str, str] = {}
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if not argv:
                continue
            if argv[-1] == "&":
                argv = argv[:-1]
            if argv[0] == "export":
                env.update(kv.split("=", 1) for kv in argv[1:])
            elif argv[0].endswith(("/vllm", "/lmcache_server")):
                out.append((argv, dict(env)))
    return out


def test_streaming_section_shows_the_tested_server_and_bench():
    cmds = commands(section(SECTIONS["streaming"]))
    serve = [(a, e) for a, e in cmds if a[1:2] == ["serve"]]
    bench = [(a, e) for a, e in cmds if a[1:3] == ["bench", "serve"]]
    assert serve == [([".venv/bin/vllm", "serve", *st.SERVE], {**BASE_ENV, **st.ENV})] + [
        ([".venv/bin/vllm", "serve", *args], {**BASE_ENV, **par.ENV})
        for args in par.SERVE.values()] + [
        ([".venv/bin/vllm", "serve", *shared.SERVE], {**BASE_ENV, **st.ENV}),
        ([".venv/bin/vllm", "serve", *with_lmcache.SERVE], {**BASE_ENV, **with_lmcache.ENV})]
    assert [a for a, _ in bench] == [[".venv/bin/vllm", "bench", "serve", *st.BENCH]]
    assert [a for a, _ in cmds if a[0].endswith("lmcache_server")] == [
        [".venv/bin/lmcache_server", *shared.LMCACHE_SERVER]]


def test_hybrid_section_shows_the_tested_servers_and_bench():
    cmds = commands(section(SECTIONS["hybrid"]))
    serve = [(a, e) for a, e in cmds if a[1:2] == ["serve"]]
    assert serve == [([".venv/bin/vllm", "serve", *lm.SERVE], {**BASE_ENV, **lm.ENV[backend]})
                     for backend in ("local-cpu", "remote")]
    assert [a for a, _ in cmds if a[1:3] == ["bench", "serve"]] == [
        [".venv/bin/vllm", "bench", "serve", *lm.BENCH]]
    assert [a for a, _ in cmds if a[0].endswith("lmcache_server")] == [
        [".venv/bin/" + lm.LMCACHE_SERVER[0], *lm.LMCACHE_SERVER[1:]]]


def test_a_taken_port_fails_clearly_before_anything_starts():
    import socket

    from vllm_server import Server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        server = Server("port-taken", st.SERVE, st.ENV, port=port)
        with pytest.raises(pytest.fail.Exception, match=f"port {port} on 127.0.0.1 is taken"):
            server.start()
        assert server.proc is None  # nothing was started
