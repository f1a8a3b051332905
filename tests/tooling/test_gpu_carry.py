"""ci/gpu/carry.py without network: what `pack --dry-run` would download (markers, extras,
the machine's packages, the optional kernels left out), and the split / reassemble round trip of
the pieces one `run` call at a time (any order, corrupt pieces refused, a fresh machine noticed),
and `install` refusing an incomplete carry."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "ci" / "gpu" / "carry.py"


@pytest.fixture(scope="module")
def carry():
    spec = importlib.util.spec_from_file_location("carry", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(*args, cwd=REPO):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=60, cwd=cwd)


METADATA = """\
Metadata-Version: 2.1
Name: vllm
Version: 0.25.1
Requires-Dist: regex
Requires-Dist: fastapi[standard]<0.137.0,>=0.133.0
Requires-Dist: msgspec
Requires-Dist: numba==0.65.0
Requires-Dist: llguidance<1.8.0,>=1.7.0; platform_machine == "x86_64" or platform_machine == "arm64"
Requires-Dist: only-on-arm; platform_machine == "aarch64"
Requires-Dist: six>=1.16.0; python_version > "3.11"
Requires-Dist: old-backport; python_version < "3.10"
Requires-Dist: flashinfer-python==0.6.13
Requires-Dist: pytest; extra == "test"
Requires-Dist: torch==2.11.0
"""


def test_dry_run_lists_what_is_missing_on_the_machine(tmp_path):
    (tmp_path / "METADATA").write_text(METADATA)
    (tmp_path / "have.txt").write_text("regex\nnumba\nsix\ntorch\n")  # names, versions unknown
    res = run("pack", "--dry-run", "--metadata", tmp_path / "METADATA", "--out", tmp_path / "out",
              "--wheels", tmp_path / "wheels", "--have", tmp_path / "have.txt")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    from kvstack.release.pins import load_pin

    assert load_pin("vllm").get("CUDA_WHEEL") in out and "to download" in out  # the base in effect
    would = out.split("would download", 1)[1].split("then the requirements", 1)[0]
    names = [ln.strip() for ln in would.splitlines()[1:] if ln.strip()]
    # x86-64, Python 3.12; regex, numba, six and torch are on the machine; flashinfer is optional
    assert names == ["fastapi[standard]<0.137.0,>=0.133.0", "msgspec", "llguidance<1.8.0,>=1.7.0"]
    assert "skipped, optional (1): flashinfer-python" in out
    assert not (tmp_path / "out").exists() and not (tmp_path / "wheels").exists()  # nothing made


def test_dry_run_with_the_machines_pip_list(tmp_path):
    (tmp_path / "METADATA").write_text(METADATA)
    (tmp_path / "have.txt").write_text("regex==2024.1.1\nnumba==0.64.0\nmsgspec==0.19.0\n"
                                       "six==1.17.0\ntorch==2.11.0+cu130\n")
    res = run("pack", "--dry-run", "--metadata", tmp_path / "METADATA", "--have",
              tmp_path / "have.txt", "--with", "flashinfer-python", "--out", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    would = res.stdout.split("would download", 1)[1]
    # numba is there but not 0.65.0; flashinfer asked for; msgspec and torch (local version) are there
    assert "numba==0.65.0" in would and "flashinfer-python==0.6.13" in would
    assert "  msgspec" not in would and "torch" not in would


def test_dry_run_reads_the_fetched_sdist_when_no_wheel_is_cached(tmp_path):
    from kvstack.release.pins import load_pin

    if not (load_pin("vllm").tree / "PKG-INFO").exists():
        pytest.skip("the vLLM sdist of this base is not fetched")
    res = run("pack", "--dry-run", "--wheels", tmp_path / "empty")
    torch_pin = [ln for ln in (load_pin("vllm").tree / "PKG-INFO").read_text().splitlines()
                 if ln.replace(" ", "").startswith("Requires-Dist:torch==")]
    if torch_pin and "2.11.0" not in torch_pin[0]:  # base 0.32: torch 2.13.0, not the machine's
        assert res.returncode == 1 and "KVSTACK_BASE=0.25" in res.stderr, (res.stdout, res.stderr)
        return
    assert res.returncode == 0, res.stderr
    assert "PKG-INFO (the sdist's" in res.stdout
    for name in ("fastapi[standard]", "pydantic", "msgspec", "pyzmq", "openai", "xgrammar"):
        assert f"  {name}" in res.stdout, name
    assert "  torch==" not in res.stdout  # the machine's torch is used


def test_a_vllm_built_on_another_torch_is_refused(tmp_path):
    """vLLM's CUDA extensions load only with the torch they were built for; the machine's torch
    (2.11.0+cu130) cannot be replaced by carrying another (~1 GB): refused, naming the base to pack."""
    (tmp_path / "METADATA").write_text(METADATA.replace("torch==2.11.0", "torch==2.13.0"))
    res = run("pack", "--dry-run", "--metadata", tmp_path / "METADATA", "--out", tmp_path / "out")
    assert res.returncode == 1
    assert "requires torch==2.13.0, the GPU machine has torch 2.11.0" in res.stderr, res.stderr
    assert "KVSTACK_BASE=0.25" in res.stderr
    (tmp_path / "have.txt").write_text("torch==2.13.0+cu130\n")  # a machine that has it: fine
    res = run("pack", "--dry-run", "--metadata", tmp_path / "METADATA", "--have", tmp_path / "have.txt",
              "--out", tmp_path / "out")
    assert res.returncode == 0, res.stderr


def test_markers_and_requirements(carry):
    env = carry.TARGET_ENV
    assert carry.eval_marker('platform_machine == "x86_64" or platform_machine == "arm64"', env)
    assert not carry.eval_marker('python_version < "3.10"', env)
    assert carry.eval_marker('python_version >= "3.9"', env)  # 3.12 > 3.9 as versions
    assert carry.eval_marker('extra == "standard" and sys_platform != "win32"', env, ("standard",))
    assert not carry.eval_marker('(extra == "dev") and python_version >= "3.8"', env)
    assert carry.eval_marker('sys_platform == "linux" and (python_version < "3.11" or '
                             'implementation_name == "cpython")', env)
    r = carry.parse_requirement('Mistral_Common[image, audio] (>=1.11.5) ; python_version > "3.8"')
    assert r == {"name": "mistral-common", "extras": ["image", "audio"], "spec": ">=1.11.5",
                 "marker": 'python_version > "3.8"'}
    assert carry.spec_satisfied("2.11.0+cu130", "==2.11.0")
    assert not carry.spec_satisfied("6.31.1", "!=6.31.*,>=5.29.6")
    assert carry.spec_satisfied(None, ">=1")


def _make_files(tmp_path):
    rng = random.Random(7)
    src = tmp_path / "src"
    src.mkdir()
    files = []
    for name, size in (("big.whl", 5 * 2**20 + 12345), ("small_a.whl", 70_000),
                       ("small_b.whl", 300_000), ("exact.whl", 2**20)):
        p = src / name
        p.write_bytes(rng.randbytes(size))
        files.append(p)
    return files


def test_split_and_reassemble_in_any_order(carry, tmp_path):
    files = _make_files(tmp_path)
    out = tmp_path / "gpu-carry"
    manifest = carry.split_into_folders(files, out, 2**20)  # 1 MiB pieces and folders
    folders = sorted(p.name for p in out.iterdir())
    assert folders == manifest["folders"] and folders[0] == "000"
    for f in folders:  # every folder fits a call: pieces <= 1 MiB in all, and the manifest
        data = sum(p.stat().st_size for p in (out / f).iterdir() if p.name != "manifest.json")
        assert data <= 2**20
        assert json.loads((out / f / "manifest.json").read_text())["id"] == manifest["id"]
    big = next(e for e in manifest["files"] if e["name"] == "big.whl")
    assert len(big["pieces"]) == 6 and sum(p["size"] for p in big["pieces"]) == big["size"]
    dest = tmp_path / "dest"
    order = list(folders)
    random.Random(1).shuffle(order)
    for i, f in enumerate(order):
        res = run("unpack", out / f, "--dest", dest)
        assert res.returncode == 0, res.stdout + res.stderr
        if i < len(order) - 1:
            assert "still to carry" in res.stdout
    assert res.stdout.strip().endswith("all folders in"), res.stdout
    for f in files:
        assert (dest / "files" / f.name).read_bytes() == f.read_bytes()
    assert not list((dest / "files").glob("*.part"))


def test_corrupt_piece_is_refused_and_fresh_machine_noticed(carry, tmp_path):
    files = _make_files(tmp_path)
    out = tmp_path / "gpu-carry"
    manifest = carry.split_into_folders(files, out, 2**20)
    piece = next(p for p in (out / "001").iterdir() if p.name != "manifest.json")
    data = bytearray(piece.read_bytes())
    data[100] ^= 0xFF
    piece.write_bytes(bytes(data))
    dest = tmp_path / "dest"
    res = run("unpack", out / "001", "--dest", dest)
    assert res.returncode == 1 and "missing or corrupt" in res.stdout
    assert "start again from 000" in res.stdout  # 001 first: earlier ones were lost or never came
    assert "still to carry: 000, 001," in res.stdout  # the corrupt folder is not counted in
    # install refuses what is not complete, before making any venv
    res = run("install", "--dest", dest, "--venv", tmp_path / "venv")
    assert res.returncode == 1 and "not complete yet" in res.stderr
    assert not (tmp_path / "venv").exists()
    res = run("install", "--dest", tmp_path / "nothing", "--venv", tmp_path / "venv")
    assert res.returncode == 1 and "holds nothing carried" in res.stderr
    assert len(manifest["folders"]) >= 6


def test_bad_usage(tmp_path):
    assert run("pack", "--piece-mib", "65", "--dry-run").returncode == 2
    (tmp_path / "empty").mkdir()
    res = run("unpack", tmp_path / "empty", "--dest", tmp_path / "d")
    assert res.returncode == 2 and "manifest.json" in res.stderr
    assert run("frobnicate").returncode == 2


def _fake_wheel(path: Path) -> Path:
    import base64
    import hashlib
    import zipfile

    files = {"kvfake/__init__.py": b"X = 1\n",
             "kvfake-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: kvfake\nVersion: 1.0\n",
             "kvfake-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\n"
                                           b"Root-Is-Purelib: true\nTag: py3-none-any\n"}
    whl = path / "kvfake-1.0-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(whl, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(data)}")
        z.writestr("kvfake-1.0.dist-info/RECORD", "\n".join(record + ["kvfake-1.0.dist-info/RECORD,,"]) + "\n")
    return whl


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs to run from a venv (the machine's "
                    "python3 is one)")
def test_install_into_a_venv_over_a_venv_python(carry, tmp_path):
    """The GPU machine's python3 is itself a venv holding torch: the new venv sees its packages
    (a .pth), and the carried wheels are installed into the new venv by that python's pip."""
    whl = _fake_wheel(tmp_path)
    carry.split_into_folders([whl], tmp_path / "out", 2**20)
    assert run("unpack", tmp_path / "out" / "000", "--dest", tmp_path / "dest").returncode == 0
    venv = tmp_path / "venv"
    res = run("install", "--dest", tmp_path / "dest", "--venv", venv, "--python", sys.executable,
              "--no-patches", "--no-check")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "is a venv: its site-packages added" in res.stdout
    probe = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import kvfake, pytest; print(kvfake.__file__)"],
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip().startswith(str(venv))  # in the new venv, pytest from the parent


def test_defaults_fit_a_call_and_carry_what_vllm_imports(carry):
    """Found on an H200 (2026-11-26): a 60 MiB folder + the 3.8 MiB tree was refused by the run
    tool, which counts more than the bytes; and vLLM 0.25.1 did not start without apache-tvm-ffi
    (xgrammar imports it)."""
    tree = carry.tree_bytes()
    assert tree is not None
    assert carry.PIECE_MIB * 2**20 + 64 * 2**10 + tree <= \
        (carry.CALL_LIMIT_MIB - carry.CALL_MARGIN_MIB) * 2**20  # a piece, its manifest, the tree
    assert "apache-tvm-ffi" not in carry.DEFAULT_SKIP
    assert "flashinfer-python" in carry.DEFAULT_SKIP


def test_gpu_env_without_flashinfer():
    from kvstack.testbed import tiny_models

    env: dict[str, str] = {}
    if importlib.util.find_spec("flashinfer") is not None:
        assert tiny_models.apply_gpu_env("qwen3next", env) == {} and env == {}
        return
    assert tiny_models.apply_gpu_env("qwen3next", env) == {
        "additional_config": {"gdn_prefill_backend": "triton"}}
    assert env == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "1"}  # a user's choice is kept
    assert tiny_models.apply_gpu_env("llama", env) == {} and env["VLLM_USE_FLASHINFER_SAMPLER"] == "1"


def test_run_checks_usage():
    script = REPO / "ci" / "gpu" / "run_checks.sh"
    res = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "--no-install" in res.stdout and "Exit status" in res.stdout
    res = subprocess.run(["bash", str(script), "--frobnicate"], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 2 and "unknown argument --frobnicate" in res.stderr


FAKE_PIP = """\
import importlib.util, shutil, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("carry", sys.argv[1])
carry = importlib.util.module_from_spec(spec)
spec.loader.exec_module(carry)
index, args = Path(sys.argv[2]), sys.argv[3:]
dest = Path(args[args.index("-d") + 1])
req = carry.parse_requirement(args[-1])
fits = [p for p in index.glob("*.whl") if carry.wheel_project(p.name) == req["name"]
        and carry.spec_satisfied(carry.wheel_version(p.name), req["spec"])]
if not fits:
    sys.exit("ERROR: No matching distribution found for " + args[-1])
best = max(fits, key=lambda p: carry.pep440_key(carry.wheel_version(p.name)))
shutil.copy(best, dest / best.name)
"""


def _wheel(index: Path, name: str, version: str, requires: list[str]) -> None:
    import zipfile

    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(index / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)


def test_conflicts_step_the_asking_wheel_down(carry, tmp_path, capsys):
    """As pip's resolver would: a wheel wanting another version of a vLLM pin or of a machine
    package steps down (gram 0.3 -> 0.1); a vLLM pin the machine's own packages cannot meet is
    not carried over the machine's version (pinned 2.0 needs np<2, the machine has np 2.5 and its
    own pinned 2.1); a pre-release tail orders right (0.2.post1 < 0.3)."""
    index, deps = tmp_path / "index", tmp_path / "deps"
    index.mkdir()
    deps.mkdir()
    _wheel(index, "gram", "0.3", ["ffi>=1.2"])
    _wheel(index, "gram", "0.2.post1", ["ffi>=1.0", "tf<5"])
    _wheel(index, "gram", "0.1", ["ffi>=1.0", "tf>=4"])
    _wheel(index, "ffi", "1.0", [])
    _wheel(index, "ffi", "1.2", [])
    _wheel(index, "pinned", "2.0", ["np<2"])
    (tmp_path / "pip.py").write_text(FAKE_PIP)
    pip = [sys.executable, str(tmp_path / "pip.py"), str(SCRIPT), str(index)]
    metadata = "Requires-Dist: gram>=0.1\nRequires-Dist: ffi==1.0\nRequires-Dist: pinned==2.0\n"
    have = {"tf": "5.1", "np": "2.5", "pinned": "2.1"}
    got, failed = carry.collect(pip, metadata, have, set(), deps)
    assert failed == []
    assert {n: carry.wheel_version(p.name) for n, p in got.items()} == {"gram": "0.1", "ffi": "1.0"}
    out = capsys.readouterr()
    assert "gram taken again with <0.3" in out.out and "gram taken again with <0.2.post1" in out.out
    assert "the machine's pinned 2.1 kept" in out.err
    assert carry.conflicts(metadata, got, {}, have) == [("vllm", "pinned", "==2.0", "2.1")]


def test_spec_satisfied_with_pre_and_post_releases(carry):
    f = carry.spec_satisfied
    assert f("0.66b2", "==0.66b2") and not f("0.66b2", "==0.66b3") and not f("0.66b2", "!=0.66b2")
    assert not f("0.2.5.post1", ">=0.2.1,<0.2.8,<0.2.5.post1") and f("0.2.3", "<0.2.5.post1")
    assert not f("0.50.0", "<0.48,>=0.47.0dev0") and f("0.47.1", "<0.48,>=0.47.0dev0")
    assert f("1.0", "==1.0.0") and f("2.1", "(>=2.0)") and f("2.11.0+cu130", ">=2.11")
    assert sorted(["0.47.0", "0.47.0.post1", "0.47.0dev0", "0.47.0rc1"], key=carry.pep440_key) == [
        "0.47.0dev0", "0.47.0rc1", "0.47.0", "0.47.0.post1"]
