"""The containers-storage an image test builds in, and the buildah calls it makes there: shared by
test_image_build.py (the cpu image) and test_image_cuda.py (the cuda image), both with the overlay
driver (vfs, which works without overlayfs, copies every layer in full: the cpu image's storage
peaked at 15 GB and kept 10.5 GB between runs that way).

Each test keeps its images in a storage of its own (`Store(root, driver)`: root/storage.conf, made
by `Store.open()`), so a run never touches the machine's default storage, and prunes after each
build what the new image no longer uses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CA_BUNDLES = [os.environ.get("PIP_CERT", ""), "/etc/ssl/certs/ca-certificates.crt"]


def ca_bundle() -> str | None:
    """A CA bundle to hand the build (a TLS-inspecting proxy's, or the system's), if any."""
    return next((c for c in CA_BUNDLES if c and Path(c).is_file()), None)


def ensure_tools() -> None:
    """buildah and mmdebstrap, installed with apt where missing (root on Debian/Ubuntu), else skip."""
    missing = [t for t in ("buildah", "mmdebstrap") if not shutil.which(t)]
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(f"needs {', '.join(missing)} (install them, or run as root on Debian/Ubuntu)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # two test workers may get here at once (both image tests): wait for dpkg's lock, not fail on it
    apt = ["apt-get", "-o", "DPkg::Lock::Timeout=600"]
    cmd = [*apt, "install", "-y", "--no-install-recommends", *missing]
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run([*apt, "update"], env=env, capture_output=True, check=True)
        subprocess.run(cmd, env=env, capture_output=True, check=True)


class Store:
    def __init__(self, root: Path, driver: str):
        self.root, self.driver = root, driver

    def open(self) -> Path:
        """Tools installed, the storage configured, containers a killed earlier run left removed."""
        ensure_tools()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "storage.conf").write_text(
            f'[storage]\ndriver = "{self.driver}"\ngraphroot = "{self.root / "storage"}"\n'
            f'runroot = "{self.root / "run"}"\n')
        self.buildah("rm", "--all", check=False)
        return self.root

    def env(self) -> dict[str, str]:
        drop = ("KVSTACK_BUILDER", "KVSTACK_STORAGE_DRIVER", "STORAGE_DRIVER", "PYTHONPATH")
        env = {k: v for k, v in os.environ.items() if k not in drop}
        env.update(CONTAINERS_STORAGE_CONF=str(self.root / "storage.conf"), BUILDAH_ISOLATION="chroot",
                   PYTHON=sys.executable)
        env["STORAGE_DRIVER"] = self.driver  # buildah's and docker_build.sh's storage driver
        return env

    def run(self, cmd: list[str], *, check: bool = True, timeout: float = 600,
            log: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """cmd in the repository, in this storage (or `env`); stdout+stderr together (live into
        `log` when given)."""
        env = env or self.env()
        if log:
            with log.open("w") as out:
                res = subprocess.run(cmd, cwd=REPO, env=env, stdout=out,
                                     stderr=subprocess.STDOUT, text=True, timeout=timeout)
            res.stdout = log.read_text()
        else:
            res = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout[-6000:]}")
        return res

    def buildah(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        return self.run(["buildah", *args], check=check, timeout=timeout)

    def image_exists(self, name: str) -> bool:
        return self.buildah("inspect", "--type", "image", name, check=False).returncode == 0

    def inspect(self, name: str) -> dict:
        return json.loads(self.buildah("inspect", "--type", "image", name).stdout)

    def prune(self, keep: list[str]) -> list[str]:
        """Remove every container, and every image none of `keep` is built on (an image is kept
        when its layers are a prefix of a kept image's: the layer cache of the current build).
        Returns the removed image ids."""
        self.buildah("rm", "--all", check=False)
        chains = [self.inspect(n)["OCIv1"]["rootfs"]["diff_ids"] for n in keep if self.image_exists(n)]
        removed = []
        for img in json.loads(self.buildah("images", "--all", "--json").stdout or "[]"):
            ids = self.inspect(img["id"])["OCIv1"]["rootfs"]["diff_ids"]
            if not any(chain[: len(ids)] == ids for chain in chains):
                if self.buildah("rmi", "--force", img["id"], check=False).returncode == 0:
                    removed.append(img["id"])
        return removed

    def deps_tag(self, build: list[str]) -> str:
        """The deps image `build` (a docker_build.sh command line) builds on, as tagged in this
        storage (`--print --deps-only`: its tag hashes the base image found here)."""
        line = self.run(["bash", *build, "--print", "--deps-only"]).stdout.strip().splitlines()[-1]
        words = line.split()
        return words[words.index("-t") + 1]

    def require_free(self, need_gb: float, what: str) -> float:
        """Fail now, naming the numbers, where the disk holding this storage has less than
        `need_gb` GB free: a build that runs out of disk fails anyway, and takes every test
        running beside it and after it down with it (the project's CI on 2026-11-30:
        `No space left on device` in hundreds of tests). Returns the free GB."""
        free = shutil.disk_usage(self.root).free / 1e9
        if free < need_gb:
            pytest.fail(f"{what} needs about {need_gb:.0f} GB of free disk, {free:.1f} GB free on "
                        f"the disk of {self.root}: not built, so as not to fill the disk under the other tests "
                        "(docs/testing.md, \"Disk\")", pytrace=False)
        return free

    def container(self, image: str):
        """A working container of `image` (a generator for a fixture: removed afterwards)."""
        name = self.buildah("from", image).stdout.strip().splitlines()[-1]
        yield name
        self.buildah("rm", name, check=False)
