"""Release sdists: download once, verify by sha256, unpack once (cache_dir()/sdists, /trees)."""

from __future__ import annotations

import re
from pathlib import Path

from kvstack.matrix.config import Config
from kvstack.matrix.states import log
from kvstack.release.fetch import sha256_of
from kvstack.release.pins import cache_dir, pin_relpath


class SourceError(RuntimeError):
    pass


def _sdist_names(project: str, version: str) -> list[str]:
    norm = re.sub(r"[-_.]+", "_", project).lower()
    return list(dict.fromkeys([f"{norm}-{version}.tar.gz", f"{project}-{version}.tar.gz"]))


def resolve_sdist(config: Config, component: str, version: str, offline: bool = False) -> tuple[Path, str, str]:
    """(sdist path, sha256, how it was verified) for one release, downloading it if needed."""
    from kvstack.release import fetch

    project = config.projects[component]
    sdists = cache_dir() / "sdists"
    expected = None
    source = ""
    if version == config.pins[component]:
        expected, source = config.pin_sha256[component], pin_relpath(component, config.base)
    elif f"{component} {version}" in config.base_sha256:
        expected, source = config.base_sha256[f"{component} {version}"]
    for name in _sdist_names(project, version):
        if expected is None and name in config.sha256:
            expected, source = config.sha256[name], "ci/matrix.toml [sha256]"
    for name in _sdist_names(project, version):
        path = sdists / name
        if not path.is_file():
            continue
        want, why = expected, source
        side = path.with_name(path.name + ".sha256")
        if want is None and side.is_file():
            want, why = side.read_text().split()[0], f"index digest recorded in {side.name}"
        if want is not None:
            got = sha256_of(path)
            if got != want:
                raise SourceError(f"sha256 mismatch for {path}: expected {want} ({why}), got {got}; "
                                  "delete the file to download it again")
            return path, got, why
    if offline:
        raise SourceError(f"{project} {version}: no verified sdist in {sdists} and --offline given")
    try:
        path = fetch.download_sdist(project, version, sdists, expected)
    except fetch.FetchError as err:
        raise SourceError(str(err)) from err
    except Exception as err:  # network errors from the index client
        raise SourceError(f"{project} {version}: download failed: {err}") from err
    digest = sha256_of(path)
    if expected is None:
        path.with_name(path.name + ".sha256").write_text(digest + "\n")
        source = "index digest"
        log(f"verified {path.name} against the index digest; to pin it, add to ci/matrix.toml [sha256]: "
            f'"{path.name}" = "{digest}"')
    return path, digest, source


TREE_STAMP = ".kvstack-sdist-sha256"


def release_tree(config: Config, component: str, version: str, offline: bool = False) -> tuple[Path, str, str]:
    """A pristine unpacked tree of one release (cached), with the sdist's sha256 and how it was verified."""
    from kvstack.release.fetch import extract_sdist

    sdist, digest, how = resolve_sdist(config, component, version, offline)
    tree = cache_dir() / "trees" / f"{config.projects[component]}-{version}"
    stamp = tree / TREE_STAMP
    if not (stamp.is_file() and stamp.read_text().strip() == digest):
        log(f"unpacking {sdist.name} into {tree}")
        extract_sdist(sdist, tree)
        stamp.write_text(digest + "\n")
    return tree, digest, how
