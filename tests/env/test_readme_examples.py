"""Every command example of README.md is run by a test (issue 12: "a README example no test runs is
a bug"). Each ```bash block is either run here verbatim (bash, from the repository root, the way a
reader pastes it), or belongs to a named test that runs exactly those commands, which is checked
(the server blocks: tests/env/server/test_readme_commands.py compares every argument; the container
block: tests/env/test_image_build.py). A new block that fits none of these fails the first test."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

pytestmark = pytest.mark.env


def blocks() -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.S | re.M)


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
    "container image": (lambda b: "buildah" in b,
                        "tests/env/test_image_build.py", ["make_base_image.sh", "docker_build.sh"]),
}
RUN_HERE = {
    "tiny models": lambda b: b.lstrip().startswith(".venv/bin/kvstack tiny-models"),
    "python heredoc": lambda b: "<<'PY'" in b and "vllm serve" not in b,
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
    found = [kind(b) for b in blocks()]
    assert None not in found, "README bash block(s) no test runs:\n\n" + "\n---\n".join(
        b for b, k in zip(blocks(), found) if k is None)
    for name, (_, test, needles) in COVERED.items():
        if name in found:
            text = (REPO / test).read_text()
            missing = [n for n in needles if n not in text]
            assert not missing, f"{test} should run the README's {name} block: {missing} not in it"


def test_the_two_commands_are_what_ci_and_the_demo_test_run():
    make = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:.*\n\t\$\(VENV\)/bin/kvstack demo\n", make, re.M)
    ci_run = (REPO / ".ci" / "run").read_text()
    assert "exec make test" in ci_run
    # under CI a backend server that cannot be had fails its test, never a skip (issue 30)
    assert 'export CI="${CI:-1}"' in ci_run


def run(block: str, timeout: int = 900) -> subprocess.CompletedProcess:
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=REPO, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def test_tiny_models_block():
    (block,) = [b for b in blocks() if kind(b) == "tiny models"]
    out = run(block).stdout
    for name in ("llama", "llama4", "qwen3next"):
        assert (REPO / "build" / "tiny-models" / name / "config.json").is_file()
    assert "LLM(" in out or "max_model_len" in out, out[-2000:]


def heredocs() -> dict[str, str]:
    out = {}
    for b in blocks():
        if kind(b) == "python heredoc":
            out["streaming" if "StreamingConnector" in b else "lmcache" if "LMCache" in b else b[:40]] = b
    return out


def token_lists(stdout: str) -> list[list[int]]:
    return [ast.literal_eval(ln) for ln in stdout.splitlines() if re.fullmatch(r"\[[\d, ]*\]", ln.strip())]


def test_streaming_example_runs_as_written():
    out = run(heredocs()["streaming"]).stdout
    (toks,) = token_lists(out)
    assert len(toks) == 8
    stats = ast.literal_eval(next(ln for ln in out.splitlines() if ln.startswith("{")))
    assert stats["pages_in_use"] == 0 and stats["failed_host_tier_full"] == 0


def test_lmcache_example_runs_as_written():
    out = run(heredocs()["lmcache"]).stdout
    first, second = token_lists(out)
    assert first == second and len(first) == 8
