"""scripts/lib_wheels.sh's fetch_wheel downloads the exact pinned file: where a find-links folder
holds a local-version build of the same release (torch 2.13.0+cpu in the cpu wheel cache, which an
image build mounts as its wheelhouse; a machine's /opt/wheels), the pin 2.13.0 must still bring the
plain 2.13.0 wheel (the CUDA build), not the +cpu one (seen on a fresh machine: the cuda image's
deps stage failed with "the registry did not provide torch-2.13.0-...whl").

Offline: two tiny wheels of one project, 1.0 and 1.0+cpu, in a folder pip reads with --no-index; the
control is pip's own `==`, which takes 1.0+cpu."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def make_wheel(folder: Path, version: str) -> Path:
    name = f"kvsdemo-{version}-py3-none-any.whl"
    dist = f"kvsdemo-{version}.dist-info"
    with zipfile.ZipFile(folder / name, "w") as z:
        z.writestr("kvsdemo/__init__.py", f"VERSION = {version!r}\n")
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: kvsdemo\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return folder / name


def fetch(tmp_path: Path, version: str, file: str, sha: str, links: Path) -> subprocess.CompletedProcess:
    wheels = tmp_path / "wheels"
    script = f"""
set -euo pipefail
venv={Path(sys.prefix)} wheels={wheels}
step() {{ echo "[test] $*"; }}
. {REPO}/scripts/lib_wheels.sh
mkdir -p "$wheels"
fetch_wheel kvsdemo {version} {file} {sha}
ls "$wheels"
"""
    env = {**os.environ, "PIP_FIND_LINKS": str(links), "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}
    env.pop("PIP_CONSTRAINT", None)
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)


def test_fetch_wheel_takes_the_exact_version_not_a_local_build(tmp_path):
    links = tmp_path / "links"
    links.mkdir()
    plain = make_wheel(links, "1.0")
    make_wheel(links, "1.0+cpu")
    sha = hashlib.sha256(plain.read_bytes()).hexdigest()
    res = fetch(tmp_path, "1.0", plain.name, sha, links)
    assert res.returncode == 0, res.stdout + res.stderr
    assert plain.name in res.stdout.split() and "kvsdemo-1.0+cpu-py3-none-any.whl" not in res.stdout, \
        res.stdout


def test_control_pips_double_equals_takes_the_local_build(tmp_path):
    """Why `===`: `pip download kvsdemo==1.0` from the same folder brings 1.0+cpu."""
    links = tmp_path / "links"
    links.mkdir()
    make_wheel(links, "1.0")
    make_wheel(links, "1.0+cpu")
    out = tmp_path / "out"
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    env.pop("PIP_CONSTRAINT", None)
    res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-index",
                          "--find-links", str(links), "-d", str(out), "kvsdemo==1.0"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert [p.name for p in out.iterdir()] == ["kvsdemo-1.0+cpu-py3-none-any.whl"]


def test_fetch_wheel_refuses_a_wrong_sha(tmp_path):
    links = tmp_path / "links"
    links.mkdir()
    plain = make_wheel(links, "1.0")
    res = fetch(tmp_path, "1.0", plain.name, "0" * 64, links)
    assert res.returncode == 3 and "sha256 mismatch" in res.stderr, res.stdout + res.stderr
