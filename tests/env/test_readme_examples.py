"""Every command example of README.md and of every docs/*.md is run by a test (issue 12: "a README
example no test runs is a bug"; issue 30 moved most of the README's manual into docs/, under the same
rule). Each ```bash block is either run here verbatim (bash, from the repository root, the way a reader
pastes it), or belongs to a named test that runs exactly those commands, which is checked (the server
blocks: tests/env/server/test_readme_commands.py compares every argument; the container block:
tests/env/test_image_build.py), or, for the GPU-only bench commands that CI cannot run, is parsed here by
the script's own argument parser (its CPU mode runs in tests/tooling/test_streaming_gpu_bench.py). A new
block that fits none of these fails the first test; a second, different block of a kind run here
verbatim fails it too (each kind is run once, so its text must be the same wherever it is shown)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvtest import default_base_only

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

pytestmark = pytest.mark.env


def doc_files() -> list[Path]:
    """README.md and every docs/*.md: the files whose bash blocks must be run by a test."""
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def blocks_by_file() -> list[tuple[Path, str]]:
    return [(path, b) for path in doc_files()
            for b in re.findall(r"^```bash\n(.*?)^```", path.read_text(), re.S | re.M)]


def blocks() -> list[str]:
    return [b for _, b in blocks_by_file()]


# block kind -> (how to recognise it, the test that runs it and strings that test must contain)
COVERED = {
    "the two commands": (lambda b: b.lstrip().startswith("make demo"),
                         "tests/env/test_demo.py", ["kvstack", "demo"]),
    "patch round trip": (lambda b: "import_patches.sh" in b,
                         "tests/tooling/test_roundtrip.py", ["import_patches", "export_patches"]),
    "regression matrix": (lambda b: "make matrix-apply" in b,
                          "tests/tooling/test_matrix.py", ["--results", "upstream_status"]),
    "servers": (lambda b: "vllm serve" in b and "buildah" not in b or "lmcache_server" in b,
                "tests/env/server/test_readme_commands.py", ["vllm serve", "lmcache_server"]),
    # docs/image.md, "The cuda image": its build and checks, and the GPU host's `docker run`
    "cuda image": (lambda b: "--target cuda" in b or "--gpus all" in b,
                   "tests/env/test_image_cuda.py",
                   ["docker_build.sh", "image_check", "test_docs_show_exactly_these_commands",
                    "test_docs_docker_run_arguments_parse_as_vllm_serve"]),
    "container image": (lambda b: "buildah" in b,
                        "tests/env/test_image_build.py", ["make_base_image.sh", "docker_build.sh"]),
    # README.md, "Install", "Your own vLLM + LMCache": run line by line in a fresh venv (it asserts the
    # block equals its steps)
    "own install": (lambda b: "apply_patches.sh --site-packages" in b,
                    "tests/env/test_own_install.py",
                    ["apply_patches.sh --site-packages", "pip install --no-deps .",
                     "pip uninstall -y torchvision torchaudio torchcodec", "kvstack doctor && vllm --version",
                     "test_readme_block_is_what_this_test_runs"]),
    # docs/hybrid-lmcache.md, "Two routes": the LMCache MP server + an engine with LMCacheMPConnector
    "LMCache multi-process route": (lambda b: "lmcache.v1.multiprocess.server" in b,
                                    "tests/env/lmcache/test_mp_route.py",
                                    ["lmcache.v1.multiprocess.server", "--supported-transfer-mode",
                                     "--disable-observability", "LMCacheMPConnector", "lmcache.mp.port"]),
}
RUN_HERE = {
    "tiny models": lambda b: b.lstrip().startswith(".venv/bin/kvstack tiny-models"),
    "python heredoc": lambda b: "<<'PY'" in b and "vllm serve" not in b,
    # docs/streaming.md, "Running it on a GPU": needs a GPU; its arguments are checked here
    "GPU bench": lambda b: "bench/streaming_gpu.py" in b,
}


def kind(block: str) -> str | None:
    for name, (match, _, _) in COVERED.items():
        if match(block):
            return name
    for name, match in RUN_HERE.items():
        if match(block):
            return name
    return None


def test_every_example_is_run_by_a_test():
    found = [(path, b, kind(b)) for path, b in blocks_by_file()]
    assert found, "no bash block found in README.md or docs/*.md"
    assert all(k is not None for _, _, k in found), "bash block(s) no test runs:\n\n" + "\n---\n".join(
        f"{path.relative_to(REPO)}:\n{b}" for path, b, k in found if k is None)
    kinds = {k for _, _, k in found}
    for name, (_, test, needles) in COVERED.items():
        if name in kinds:
            text = (REPO / test).read_text()
            missing = [n for n in needles if n not in text]
            assert not missing, f"{test} should run the docs' {name} block: {missing} not in it"
    # Each kind run here verbatim runs one text: a second, different one would go untested.
    for name in ("tiny models",):
        texts = {b for _, b, k in found if k == name}
        assert len(texts) <= 1, f"{len(texts)} different {name} blocks; show one text or add a test"
    heredocs()  # one text per heredoc key (asserted there)


def test_the_two_commands_are_what_ci_and_the_demo_test_run():
    make = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:.*\n\t\$\(VENV\)/bin/kvstack demo\n", make, re.M)
    ci_run = (REPO / ".ci" / "run").read_text()
    # exactly the README's test command, and no other make run (its time and status:
    # tests/tooling/test_ci_run.py)
    assert re.findall(r"^\s*(?:exec\s+)?make\b.*$", ci_run, re.M) == ["make test || rc=$?"], ci_run
    # under CI a backend server that cannot be had fails its test, never a skip (issue 30)
    assert 'export CI="${CI:-1}"' in ci_run


def run(block: str, timeout: int = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=REPO, capture_output=True,
                         text=True, timeout=timeout, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def test_tiny_models_block():
    (block,) = {b for b in blocks() if kind(b) == "tiny models"}
    out = run(block).stdout
    for name in ("llama", "llama4", "qwen3next"):
        assert (REPO / "build" / "tiny-models" / name / "config.json").is_file()
    assert "LLM(" in out or "max_model_len" in out, out[-2000:]


def heredocs() -> dict[str, str]:
    """The python heredoc blocks by what they show; each key has one text in all the files (a block
    shown twice must be the same), and each key has a test below that runs it."""
    texts: dict[str, set[str]] = {}
    for b in blocks():
        if kind(b) == "python heredoc":
            key = "streaming" if "StreamingConnector" in b else "lmcache" if "LMCache" in b else b[:40]
            texts.setdefault(key, set()).add(b)
    twice = {k: len(v) for k, v in texts.items() if len(v) > 1}
    assert not twice, f"python heredocs shown in different texts (only one is run): {twice}"
    assert set(texts) <= {"streaming", "lmcache"}, f"a heredoc no test below runs: {set(texts)}"
    return {k: next(iter(v)) for k, v in texts.items()}


def token_lists(stdout: str) -> list[list[int]]:
    return [ast.literal_eval(ln) for ln in stdout.splitlines() if re.fullmatch(r"\[[\d, ]*\]", ln.strip())]


EXAMPLE_BASE = default_base_only("the README's examples run on the default base, as `make env` builds it; "
                                 "the other bases' engines run the same connectors in tests/env/streaming "
                                 "and tests/env/lmcache")


@EXAMPLE_BASE
def test_streaming_example_runs_as_written():
    out = run(heredocs()["streaming"]).stdout
    (toks,) = token_lists(out)
    assert len(toks) == 8
    stats = ast.literal_eval(next(ln for ln in out.splitlines() if ln.startswith("{")))
    assert stats["pages_in_use"] == 0 and stats["failed_host_tier_full"] == 0


@EXAMPLE_BASE
def test_lmcache_example_runs_as_written():
    """The repeat restores the K/V and the state at 96 with the first run's tokens; the negative
    control runs the block again with every restored state zeroed (tests/env/lmcache/fault_site,
    KVSTACK_ZERO_RESTORED_STATE): the first run restores nothing and gives the same tokens, the
    repeat restores as much and gives others (the example's model depends on its state)."""
    block = heredocs()["lmcache"]
    res = run(block)
    first, second = token_lists(res.stdout)
    assert first == second and len(first) == 8
    assert "restored hybrid state at 96" in res.stdout + res.stderr
    site = REPO / "tests" / "env" / "lmcache" / "fault_site"
    env = {**os.environ, "KVSTACK_ZERO_RESTORED_STATE": "1",
           "PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])}
    res = run(block, env=env)
    z_first, z_second = token_lists(res.stdout)
    assert "zeroed pid=" in res.stderr and "restored hybrid state at 96" in res.stdout + res.stderr
    assert z_first == first and z_second != first, "a zeroed state must change the repeat's tokens"


def test_gpu_bench_commands_parse():
    """The GPU-only commands (docs/streaming.md, "Running it on a GPU") need a GPU, which CI does not
    have: each `python bench/streaming_gpu.py ...` line is parsed by the script's own parser here
    (an unknown option or a bad value fails), and its CPU mode runs in
    tests/tooling/test_streaming_gpu_bench.py."""
    spec = importlib.util.spec_from_file_location("streaming_gpu", REPO / "bench" / "streaming_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    lines = [ln for b in blocks() if kind(b) == "GPU bench"
             for ln in b.replace("\\\n", " ").splitlines() if "bench/streaming_gpu.py" in ln]
    assert lines, "no GPU bench command found"
    for line in lines:
        argv = shlex.split(line.split("2>&1")[0].split("|")[0], comments=True)
        assert argv[:2] == ["python", "bench/streaming_gpu.py"], line
        args = mod.parse_args(argv[2:])
        assert {o.strip() for o in args.page_order.split(",")} <= {"contiguous", "shuffled"}, line
        for ctx in args.contexts.split(","):
            assert ctx.strip() == "max" or mod.parse_tokens(ctx) > 0, line
        assert all(int(b) > 0 for b in args.decode_batch.split(",")), line
        assert {v.strip() for v in args.decode.split(",")} <= {"stream", "host"}, line
