"""The server examples of the docs are exactly the commands the server tests run: every
``vllm serve`` / ``vllm bench serve`` / ``lmcache_server`` line of docs/streaming-usage.md ("Running
streaming attention ...") and docs/hybrid-lmcache-usage.md ("Running hybrid models with LMCache ...")
(with the ``export`` lines before it in the same code block) equals the arguments and environment of
tests/env/server, and every server the tests start is shown there; no other bash block of README.md or
docs/*.md shows a server (the container image's block is tests/env/test_image_build.py's). Also: a taken
port fails with a clear message before anything starts. Runs in a second, no server needed."""

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

# The files whose server blocks the tests below compare (issue 30 moved them out of README.md).
FILES = {"streaming": ROOT / "docs" / "streaming-usage.md", "hybrid": ROOT / "docs" / "hybrid-lmcache-usage.md"}


def section(name: str) -> str:
    return FILES[name].read_text()


def doc_files() -> list:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


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
    cmds = commands(section("streaming"))
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
    cmds = commands(section("hybrid"))
    serve = [(a, e) for a, e in cmds if a[1:2] == ["serve"]]
    assert serve == [([".venv/bin/vllm", "serve", *lm.SERVE], {**BASE_ENV, **lm.ENV[backend]})
                     for backend in ("local-cpu", "remote")]
    assert [a for a, _ in cmds if a[1:3] == ["bench", "serve"]] == [
        [".venv/bin/vllm", "bench", "serve", *lm.BENCH]]
    assert [a for a, _ in cmds if a[0].endswith("lmcache_server")] == [
        [".venv/bin/" + lm.LMCACHE_SERVER[0], *lm.LMCACHE_SERVER[1:]]]


def test_no_server_block_elsewhere():
    """A server block outside the two files above would be compared with nothing."""
    others = []
    for path in doc_files():
        if path in FILES.values():
            continue
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            if "buildah" not in block and commands("```bash\n" + block + "```"):
                others.append(f"{path.relative_to(ROOT)}:\n{block}")
    assert not others, "server commands no test compares:\n" + "\n---\n".join(others)


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
