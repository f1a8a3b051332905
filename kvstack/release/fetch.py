"""Fetch the pinned upstream sdists, verify their sha256 and unpack them.

`pip download` cannot fetch vLLM's sdist (it builds metadata, which needs
torch/CUDA), so the file is resolved through the registry's simple index
(PEP 503/691) with the `pypi-simple` client, which follows pip's index
(`PIP_INDEX_URL` when set). Downloads are cached under `$KVSTACK_CACHE`
(default ~/.cache/kvstack) so fresh clones do not download again.

Nothing is unpacked unless the sha256 matches: a mismatch is refused with
both digests named, and the existing tree (if any) is left as it was.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from kvstack.release.pins import COMPONENTS, Pin, base_names, cache_dir, default_base, load_pin

STAMP = ".kvstack-fetched"
EXIT_OK, EXIT_MISMATCH, EXIT_DOWNLOAD = 0, 3, 4


class FetchError(RuntimeError):
    exit_code = EXIT_DOWNLOAD


class Sha256Mismatch(FetchError):
    exit_code = EXIT_MISMATCH


def log(msg: str) -> None:
    print(f"[fetch] {msg}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise Sha256Mismatch(
            f"sha256 mismatch for {path}:\n  expected {expected}\n  actual   {actual}\n"
            "Refusing to use it; nothing was unpacked. If this is a corrupt cached download, "
            "delete the file and run again."
        )


def _pypi_simple():
    """Import pypi-simple, installing it into kvstack's cache on first use."""
    tools = cache_dir() / "tools"
    if str(tools) not in sys.path:
        sys.path.insert(0, str(tools))
    try:
        import pypi_simple  # noqa: F401
    except ImportError:
        log(f"installing the pypi-simple index client into {tools}")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(tools), "pypi-simple>=1.5"],
            check=True,
        )
        import importlib

        importlib.invalidate_caches()
    import pypi_simple

    return pypi_simple


def download_sdist(project: str, version: str, dest_dir: Path, expected_sha256: str | None = None) -> Path:
    """Return the sdist of project==version in dest_dir, downloading it if absent.

    With expected_sha256 the file must match it; otherwise it must match the
    digest the index publishes.
    """
    ps = _pypi_simple()
    dest_dir.mkdir(parents=True, exist_ok=True)
    endpoint = os.environ.get("PIP_INDEX_URL") or ps.PYPI_SIMPLE_ENDPOINT
    with ps.PyPISimple(endpoint=endpoint) as client:
        page = client.get_project_page(project)
        candidates = [p for p in page.packages if p.version == version and p.package_type == "sdist"]
        if not candidates:
            raise FetchError(f"the index has no sdist of {project}=={version}")
        pkg = candidates[0]
        target = dest_dir / pkg.filename
        if target.exists():
            verify(target, expected_sha256 or pkg.digests.get("sha256", ""))
            return target
        log(f"downloading {pkg.filename}")
        fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=".part-")
        os.close(fd)
        try:
            client.download_package(pkg, path=tmp, verify=True)
            if expected_sha256:
                verify(Path(tmp), expected_sha256)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def cached_sdist(pin: Pin) -> Path:
    """The pinned sdist in the cache, downloaded and verified if needed."""
    path = cache_dir() / "sdists" / pin.sdist
    if path.exists():
        verify(path, pin.sdist_sha256)
        return path
    got = download_sdist(pin.project, pin.version, path.parent, pin.sdist_sha256)
    if got.name != pin.sdist:
        raise FetchError(f"the index names the sdist {got.name}, the pin says {pin.sdist}")
    return got


def extract_sdist(sdist: Path, dest: Path) -> None:
    """Unpack sdist's single top-level folder as dest (created atomically)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
    try:
        with tarfile.open(sdist) as tar:
            tar.extractall(staging, filter="data")
        tops = [p for p in staging.iterdir()]
        if len(tops) != 1 or not tops[0].is_dir():
            raise FetchError(f"{sdist.name}: expected one top-level folder, found {[p.name for p in tops]}")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tops[0], dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def fetch(pin: Pin, sdist: Path | None = None, force: bool = False) -> Path:
    """Make pin.tree the verified, unpacked sdist. Idempotent."""
    stamp = pin.tree / STAMP
    if sdist is None and not force and stamp.exists() and stamp.read_text().strip() == pin.sdist_sha256:
        log(f"{pin.component}: {pin.tree} already holds {pin.sdist} (verified); nothing to do")
        return pin.tree
    if sdist is not None:
        verify(sdist, pin.sdist_sha256)
    else:
        sdist = cached_sdist(pin)
    log(f"{pin.component}: sha256 ok ({pin.sdist_sha256[:12]}...); unpacking into {pin.tree}")
    extract_sdist(sdist, pin.tree)
    stamp.write_text(pin.sdist_sha256 + "\n")
    return pin.tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/fetch_sources.sh",
        description="Download a base's pinned upstream sdists (cached), verify sha256, unpack them into "
        "<component>/src/<base>/ (vllm/src/<base>, lmcache/src/<base>; git-ignored).",
        epilog=f"Exit codes: {EXIT_OK} ok, {EXIT_MISMATCH} sha256 mismatch (nothing unpacked), "
        f"{EXIT_DOWNLOAD} download/index error, 2 usage.",
    )
    parser.add_argument("components", nargs="*", choices=[[], *COMPONENTS], default=[],
                        help="components to fetch (default: all)")
    parser.add_argument("--base", choices=base_names(), action="append",
                        help="which base (repeat for several; default $KVSTACK_BASE, else vllm/default)")
    parser.add_argument("--all-bases", action="store_true", help="fetch the sdists of every base")
    parser.add_argument("--sdist", type=Path, help="verify and unpack this local file instead of the cached download")
    parser.add_argument("--force", action="store_true", help="unpack again even if the tree is already there")
    args = parser.parse_args(argv)
    components = args.components or list(COMPONENTS)
    if args.sdist and len(components) != 1:
        parser.error("--sdist needs exactly one component")
    bases = base_names() if args.all_bases else (args.base or [default_base()])
    if args.sdist and len(bases) != 1:
        parser.error("--sdist needs exactly one base")
    try:
        for base in bases:
            for comp in components:
                fetch(load_pin(comp, base), sdist=args.sdist, force=args.force)
    except FetchError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
