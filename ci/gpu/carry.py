#!/usr/bin/env python3
"""Carry the pinned vLLM CUDA wheel and its missing dependencies to the GPU machine, in pieces.

The GPU machine (reached through the `run` tool: it copies the working tree, at most 64 MiB a
call, nothing can be downloaded there, and it goes back after ~30 s idle) has Python 3.12, torch
2.11.0+cu130, Triton, transformers and a long list of packages (DEFAULT_HAVE below, from the
machine's image as read on 2026-11-17), but no vLLM, no LMCache and little of vLLM's serving stack.
Standard library only: `pack` runs here, `unpack` and `install` there, both with a bare python3.

  pack     (here) download with pip the pinned vLLM CUDA wheel (vllm/<base>.env: CUDA_WHEEL,
           sha256-verified, cached in ~/.cache/kvstack/wheels like scripts/lib_wheels.sh) and the
           cp312 manylinux wheels of its requirements the machine lacks (vLLM's Requires-Dist,
           markers evaluated for the machine, minus DEFAULT_HAVE or `--have FILE`, minus the
           optional heavy kernels of DEFAULT_SKIP; then the same for each downloaded wheel's own
           requirements, until nothing is missing), each with `pip download --no-deps
           --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 ...`;
           then split everything into pieces of at most `--piece-mib` (56) MiB, packed into
           folders build/gpu-carry/000, 001, ... (git-ignored), each with manifest.json (file
           names, sizes, sha256 of each whole file and of each piece). `--dry-run` lists what it
           would download (from the cached wheel's METADATA, else vllm/src/<base>/PKG-INFO, else
           `--metadata FILE`) and changes nothing.
  unpack   (there) `unpack build/gpu-carry/NNN`: check the folder's pieces (sha256) and write
           them into a persistent folder on the machine (`--dest`, default /tmp/kvstack-carry);
           a file is verified (sha256 of the whole) as soon as its last piece is in. Prints what
           is still missing. Pieces may come in any order, one folder per call.
  install  (there) every file complete: `python3 -m venv --system-site-packages --without-pip
           VENV` plus a .pth naming the site-packages of the machine's python3 (itself a venv:
           /opt/torch/.venv), so its torch is used; `python3 -m pip --python VENV install
           --no-index --no-deps` of every carried wheel,
           kvstack's patch stack (`scripts/apply_patches.sh --site-packages`), an import check
           of the engine's modules, and `vllm --version`.

The sequence of `run` calls (ci/gpu/README.md says the same, with the budget):

  here:   KVSTACK_BASE=0.25 python3 ci/gpu/carry.py pack   # prints N folders and the run calls
          (base 0.25: its vLLM 0.25.1 is built on the machine's torch 2.11; base 0.32's vLLM needs
          torch 2.13 and is refused, see MACHINE_TORCH)
  run 1:  carry ["build/gpu-carry/000"]
          command: python3 ci/gpu/carry.py unpack build/gpu-carry/000 &&
                   python3 -m pip list --format=freeze > $OUT/have.txt
  run 2 .. N: carry ["build/gpu-carry/001"], ... one folder per call, command
          python3 ci/gpu/carry.py unpack build/gpu-carry/NNN
  run N+1: bash ci/gpu/run_checks.sh --layout-s 180 --streaming-s 300      (timeout_s 600)
           (install, then check_layout.py and check_streaming.py, logs into $OUT as they go)
  With the default lists (2026-11-26): the 250 MB wheel + 87 dependency wheels make 6 folders,
  so 7 calls; about 7 of the session's 15 device minutes, measured on an H200 (ci/gpu/README.md).

Each call must follow the previous one within ~30 s (the machine is given back when idle, and a
fresh one is bare: the pieces already unpacked are gone, and `unpack` then says to start again
from 000). A call carries one folder (<= 56 MiB) plus the working tree (~4 MiB): keep the sum
1.5 MiB under 64 MiB (the tool counts more than the bytes). The machine's packages are read from
ci/gpu/machine-packages.txt (its `pip list` of 2026-11-26; else the names of DEFAULT_HAVE): if
`have.txt` (run 1) differs, copy it there for the next session. The machine's packages of known
version stay as they are; a carried wheel whose requirements they (or another carried wheel, or a
pin of vLLM's) do not meet is taken one version lower until they are met, as pip's resolver would
(xgrammar 0.2.8 -> 0.2.3 for vLLM 0.25.1's apache-tvm-ffi==0.1.9 and the machine's transformers 5);
what cannot be met is printed as a warning.

Exit status: 0 done; 1 a download, a check or an install step failed (unpack: a piece is
missing or corrupt); 2 bad usage.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from kvstack.release.fetch import sha256_of  # noqa: E402  (standard library only)

DEFAULT_OUT = ROOT / "build" / "gpu-carry"
DEFAULT_DEST = Path("/tmp/kvstack-carry")
DEFAULT_VENV = Path("/tmp/kvstack-venv")
# the machine's own `pip list --format=freeze` (call 1 writes have.txt: copy it here when it changes)
MACHINE_PACKAGES = Path(__file__).resolve().parent / "machine-packages.txt"
PIECE_MIB = 56  # 330 MiB of wheels (2026-11-26) still make 6 folders; room for the tree to grow
CALL_LIMIT_MIB = 64
# the run tool refused a folder of 60.0 MiB + a 3.8 MiB tree (63.9 MiB) on 2026-11-26: it counts
# more than the files' bytes, so a call is planned to leave this much unused
CALL_MARGIN_MIB = 1.5
MANIFEST = "manifest.json"
# The GPU machine's Python: its wheels are cp312 manylinux (x86-64); markers are evaluated for it.
TARGET_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
    "platform_python_implementation": "CPython", "implementation_name": "cpython",
    "implementation_version": "3.12.3", "platform_release": "", "platform_version": "",
}
# pip matches a --platform tag exactly: name every manylinux_2_N the machine's glibc (2.39,
# Ubuntu 24.04) runs, newest first, and the legacy aliases.
PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)) + (
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64")
# The packages of the GPU machine's image ('cuda'), as read on 2026-11-17 (the device tool's
# KINDS.md). Override with `--have FILE` (`python3 -m pip list --format=freeze` run there).
DEFAULT_HAVE = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils
execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py
hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax
jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib
mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()
# The machine's torch (2.11.0+cu130 in the image's list of 2026-11-17). vLLM's compiled extensions
# load only with the torch they were built for, and torch cannot be carried (~1 GB with its CUDA
# libraries): a base whose vLLM pins another torch cannot run there (base 0.32: torch 2.13.0).
MACHINE_TORCH = "2.11.0"


def torch_mismatch(metadata: str, have: dict, base: str) -> str | None:
    """Why the vLLM of `metadata` cannot run on the machine (its torch pin is not the machine's
    torch), or None."""
    machine = have.get("torch") or MACHINE_TORCH
    for line in requires_dist(metadata):
        req = parse_requirement(line)
        if req["name"] == "torch" and not req["marker"] and req["spec"]:
            if not spec_satisfied(machine, req["spec"]):
                return (f"base {base}'s vLLM requires torch{req['spec']}, the GPU machine has torch "
                        f"{machine}: vLLM's CUDA extensions would not load there, and torch cannot be "
                        f"carried. Pack a base whose vLLM is built on torch {machine} (base 0.25: "
                        f"KVSTACK_BASE=0.25 python3 ci/gpu/carry.py pack; the install command then "
                        f"applies that base's patches)")
    return None


# Optional kernels and media codecs of vLLM's CUDA requirements that the tiny-model checks do not
# import (vLLM looks for each with find_spec and falls back), and that would cost calls: FlashInfer
# and its cubins, TileLang, CUTLASS DSL, the MLA/quack/humming kernels, video decoders. `--with NAME`
# carries one anyway; `--skip NAME` adds one. Not apache-tvm-ffi (3 MB): xgrammar 0.2.8 imports it,
# and vLLM imports xgrammar at start-up (H200, 2026-11-26). Without FlashInfer, vLLM 0.25.1's
# sampler still imports it unless VLLM_USE_FLASHINFER_SAMPLER=0, and Qwen3-Next's GDN prefill
# needs `gdn_prefill_backend: triton`: the checks set both (tiny_models.apply_gpu_env).
DEFAULT_SKIP = """
flashinfer-python flashinfer-cubin flashinfer-jit-cache tilelang nvidia-cutlass-dsl
nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-cu13 quack-kernels humming-kernels
tokenspeed-mla pynvvideocodec torchcodec fastsafetensors nvidia-cudnn-frontend
""".split()


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ----------------------------------------------------------------------------- requirements

_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(\(?[^;]*?\)?)\s*(?:;\s*(.*))?$")


def parse_requirement(line: str) -> dict:
    """'name[extra1,extra2] >=1,<2 ; marker' -> {name, extras, spec, marker}."""
    m = _REQ.match(line)
    if not m:
        raise ValueError(f"cannot parse requirement {line!r}")
    extras = [norm(e.strip()) for e in (m.group(2) or "[]")[1:-1].split(",") if e.strip()]
    spec = (m.group(3) or "").strip().strip("()").replace(" ", "")
    return {"name": norm(m.group(1)), "extras": extras, "spec": spec,
            "marker": (m.group(4) or "").strip()}


def _compare(left: str, op: str, right: str) -> bool:
    if re.fullmatch(r"[0-9][0-9.]*", left) and re.fullmatch(r"[0-9][0-9.]*", right.rstrip(".*")):
        if op in ("==", "!=") and right.endswith(".*"):
            pre = right[:-2].split(".")
            eq = left.split(".")[:len(pre)] == pre
            return eq if op == "==" else not eq
        a = [int(x) for x in left.split(".")]
        b = [int(x) for x in right.split(".")]
        n = max(len(a), len(b))
        a, b = a + [0] * (n - len(a)), b + [0] * (n - len(b))
    else:
        a, b = left, right
    return {"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b,
            "===": a == b, "~=": a >= b}[op]


def eval_marker(marker: str, env: dict, extras: tuple[str, ...] = ()) -> bool:
    """A PEP 508 environment marker, for `env` and the requested `extras` (stdlib only:
    variables, quoted strings, comparisons incl. `in`/`not in`, `and`, `or`, parentheses)."""
    if not marker.strip():
        return True
    tokens = re.findall(r"\(|\)|'[^']*'|\"[^\"]*\"|===|==|!=|<=|>=|~=|<|>|\bnot\s+in\b|\bin\b|"
                        r"\band\b|\bor\b|[A-Za-z_][A-Za-z0-9_.]*", marker)
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def take():
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def value(tok):
        if tok[0] in "'\"":
            return ("lit", tok[1:-1])
        return ("var", tok)

    def atom() -> bool:
        if peek() == "(":
            take()
            r = disj()
            take()  # ")"
            return r
        left, op, right = value(take()), re.sub(r"\s+", " ", take()), value(take())
        if "extra" in (left[1] if left[0] == "var" else "", right[1] if right[0] == "var" else ""):
            lit = right[1] if left[0] == "var" else left[1]
            hit = norm(lit) in extras
            return hit if op == "==" else (not hit if op == "!=" else False)
        lv = env.get(left[1], "") if left[0] == "var" else left[1]
        rv = env.get(right[1], "") if right[0] == "var" else right[1]
        if op == "in":
            return lv in rv
        if op == "not in":
            return lv not in rv
        return _compare(lv, op, rv)

    def conj() -> bool:
        r = atom()
        while peek() == "and":
            take()
            r = atom() and r
        return r

    def disj() -> bool:
        r = conj()
        while peek() == "or":
            take()
            r = conj() or r
        return r

    return disj()


def pep440_key(version: str) -> tuple:
    """An ordering key for versions with pre, post and dev parts (0.47.0dev0 < 0.47.0rc1 <
    0.47.0 < 0.47.0.post1); an unparsable tail counts as a final release."""
    m = re.match(r"(\d+(?:\.\d+)*)(?:[.-]?(a|b|rc)(\d*))?(?:[.-]?post(\d*))?(?:[.-]?dev(\d*))?",
                 version.strip().lower())
    if not m:
        return ((0,) * 6, (1,), -1, (1,))
    rel = tuple(int(x) for x in m.group(1).split("."))
    rel = rel + (0,) * (6 - len(rel))
    pre = (0, m.group(2), int(m.group(3) or 0)) if m.group(2) else (1,)
    post = int(m.group(4) or 0) if m.group(4) is not None else -1
    dev = (0, int(m.group(5) or 0)) if m.group(5) is not None else (1,)
    if m.group(5) is not None and not m.group(2) and m.group(4) is None:
        pre = (-1,)  # X.devN comes before X's pre-releases
    return (rel, pre, post, dev)


def spec_satisfied(version: str | None, spec: str) -> bool:
    """Whether `version` meets `spec` ('>=1,<2'); unknown version or unparsable spec: True.
    Local labels are ignored (2.11.0+cu130 == 2.11.0), pre/post/dev parts ordered (pep440_key)."""
    if not version or not spec:
        return True
    public = version.split("+", 1)[0]
    try:
        for clause in spec.strip().strip("()").split(","):
            m = re.fullmatch(r"(===|==|!=|<=|>=|~=|<|>)\s*(.+)", clause.strip())
            if not m:
                continue
            op, right = m.group(1), m.group(2).strip().split("+", 1)[0]
            if right.endswith(".*"):  # prefix match of the release numbers
                release = re.sub(r"\.?[a-z].*$", "", public)
                eq = release.split(".")[:len(right[:-2].split("."))] == right[:-2].split(".")
                if eq != (op in ("==", "===")):
                    return False
                continue
            a, b = pep440_key(public), pep440_key(right)
            if not {"==": a == b, "===": a == b, "!=": a != b, "<": a < b, "<=": a <= b,
                    ">": a > b, ">=": a >= b, "~=": a >= b}[op]:
                return False
    except (ValueError, KeyError):
        return True
    return True


def requires_dist(metadata: str) -> list[str]:
    return [ln.split(":", 1)[1].strip() for ln in metadata.splitlines()
            if ln.startswith("Requires-Dist:")]


def wheel_metadata(whl: Path) -> str:
    with zipfile.ZipFile(whl) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode("utf-8", "replace")


def wheel_project(filename: str) -> str:
    return norm(filename.split("-")[0])


def needed(metadata: str, extras: tuple[str, ...], have: dict, skip: set) -> tuple[list, list, list]:
    """Requirements of one distribution for the machine: (to carry, already there, skipped)."""
    carry, there, skipped = [], [], []
    for line in requires_dist(metadata):
        req = parse_requirement(line)
        if not eval_marker(req["marker"], TARGET_ENV, extras):
            continue
        if req["name"] in skip:
            skipped.append(req)
        elif req["name"] in have and spec_satisfied(have[req["name"]], req["spec"]):
            there.append(req)
        else:
            carry.append(req)
    return carry, there, skipped


def read_have(path: Path | None) -> dict:
    """name -> version (None when unknown) of what the machine has."""
    if path is None:
        return {norm(n): None for n in DEFAULT_HAVE}
    have = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([^\s;]+)|\s+([0-9][^\s]*)|@.*)?", line)
        if m:
            have[norm(m.group(1))] = m.group(2) or m.group(3)
    return have


# ----------------------------------------------------------------------------- pieces

def split_into_folders(files: list[Path], out: Path, piece_bytes: int, base: str | None = None) -> dict:
    """Cut `files` into pieces of at most `piece_bytes` and pack them, first fit in order, into
    folders out/000, out/001, ... of at most `piece_bytes` each; write out/NNN/manifest.json
    (the whole plan, the same in every folder). Returns the manifest."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    entries, pieces = [], []
    for f in files:
        size = f.stat().st_size
        entry = {"name": f.name, "size": size, "sha256": sha256_of(f), "pieces": []}
        offset, idx = 0, 0
        while offset < size or (size == 0 and idx == 0):
            n = min(piece_bytes, size - offset)
            entry["pieces"].append({"file": f"{f.name}.{idx:03d}", "offset": offset, "size": n})
            pieces.append((f, entry["pieces"][-1]))
            offset += n
            idx += 1
        entries.append(entry)
    folders: list[int] = []  # bytes used per folder
    for f, piece in pieces:
        slot = next((i for i, used in enumerate(folders) if used + piece["size"] <= piece_bytes), None)
        if slot is None:
            folders.append(0)
            slot = len(folders) - 1
        folders[slot] += piece["size"]
        piece["folder"] = f"{slot:03d}"
        dest = out / piece["folder"]
        dest.mkdir(exist_ok=True)
        h = hashlib.sha256()
        with f.open("rb") as src, (dest / piece["file"]).open("wb") as dst:
            src.seek(piece["offset"])
            left = piece["size"]
            while left:
                chunk = src.read(min(left, 1 << 20))
                h.update(chunk)
                dst.write(chunk)
                left -= len(chunk)
        piece["sha256"] = h.hexdigest()
    manifest = {"version": 1, "folders": [f"{i:03d}" for i in range(len(folders))],
                "piece_bytes": piece_bytes, "files": entries}
    if base is not None:
        manifest["base"] = base  # `install` applies this base's patch stack
    manifest["id"] = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    for folder in manifest["folders"]:
        (out / folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def unpack_folder(folder: Path, dest: Path) -> tuple[bool, list[str]]:
    """Take the pieces of one carried folder into `dest` (persistent across calls). Returns
    (every piece of this folder good, report lines)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    state_file = dest / "state.json"
    state = {}
    if state_file.exists():
        state = json.loads(state_file.read_text())
    if state.get("id") != manifest["id"]:
        if dest.exists():
            shutil.rmtree(dest)
        state = {"id": manifest["id"], "folders": [], "pieces": [], "complete": []}
    (dest / "files").mkdir(parents=True, exist_ok=True)
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    lines, ok = [], True
    name = folder.name
    for entry in manifest["files"]:
        part = dest / "files" / (entry["name"] + ".part")
        for piece in entry["pieces"]:
            if piece["folder"] != name:
                continue
            src = folder / piece["file"]
            if not src.exists() or src.stat().st_size != piece["size"] or sha256_of(src) != piece["sha256"]:
                lines.append(f"error: piece {piece['file']} of folder {name} is missing or corrupt")
                ok = False
                continue
            mode = "r+b" if part.exists() else "wb"
            with src.open("rb") as s, part.open(mode) as d:
                d.seek(piece["offset"])
                shutil.copyfileobj(s, d, 1 << 20)
            if piece["file"] not in state["pieces"]:
                state["pieces"].append(piece["file"])
        got = [p["file"] in state["pieces"] for p in entry["pieces"]]
        if all(got) and entry["name"] not in state["complete"]:
            final = dest / "files" / entry["name"]
            if part.exists():
                os.replace(part, final)
            elif entry["size"] == 0:
                final.write_bytes(b"")
            if final.exists() and final.stat().st_size == entry["size"] and sha256_of(final) == entry["sha256"]:
                state["complete"].append(entry["name"])
                lines.append(f"complete: {entry['name']} ({entry['size']} bytes, sha256 ok)")
            else:
                lines.append(f"error: {entry['name']} is complete but its sha256 does not match")
                final.unlink(missing_ok=True)
                state["pieces"] = [p for p in state["pieces"]
                                   if p not in {q["file"] for q in entry["pieces"]}]
                ok = False
    if ok and name not in state["folders"]:
        state["folders"].append(name)
    state_file.write_text(json.dumps(state))
    missing = [f for f in manifest["folders"] if f not in state["folders"]]
    done = len(state["complete"])
    lines.append(f"folder {name} in; {done}/{len(manifest['files'])} files complete; "
                 + (f"still to carry: {', '.join(missing)}" if missing else "all folders in"))
    return ok, lines


def carried_status(dest: Path) -> tuple[dict | None, list[str]]:
    """(manifest, names of incomplete files) of what `dest` holds."""
    try:
        manifest = json.loads((dest / MANIFEST).read_text())
        state = json.loads((dest / "state.json").read_text())
    except (OSError, ValueError):
        return None, []
    return manifest, [e["name"] for e in manifest["files"] if e["name"] not in state["complete"]]


def tree_bytes() -> int | None:
    """Bytes of the working tree the run tool sends (tracked + untracked-not-ignored)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    total = 0
    for rel in out.decode().split("\0"):
        if rel:
            try:
                total += (ROOT / rel).stat().st_size
            except OSError:
                pass
    return total


# ----------------------------------------------------------------------------- pack

def pip_download(pip: list[str], reqs: list[str], dest: Path) -> tuple[bool, str]:
    cmd = [*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
           *[a for p in PLATFORMS for a in ("--platform", p)], "--platform", "any",
           "--quiet", "-d", str(dest), *reqs]
    res = subprocess.run(cmd, capture_output=True, text=True)
    return res.returncode == 0, (res.stderr or res.stdout).strip()


def vllm_metadata(args, pin: dict, wheels: Path) -> tuple[str, str]:
    """(METADATA text, where from) of the pinned CUDA wheel."""
    if args.metadata:
        return args.metadata.read_text(), str(args.metadata)
    whl = wheels / pin["CUDA_WHEEL"]
    if whl.exists():
        return wheel_metadata(whl), str(whl)
    from kvstack.release.pins import load_pin

    pkg_info = load_pin("vllm").tree / "PKG-INFO"
    if args.dry_run and pkg_info.exists():
        return pkg_info.read_text(), f"{pkg_info} (the sdist's; the CUDA wheel is not cached yet)"
    raise FileNotFoundError(whl)


def fetch_vllm(pip: list[str], pin: dict, wheels: Path) -> Path:
    whl = wheels / pin["CUDA_WHEEL"]
    if not whl.exists():
        print(f"downloading {pin['CUDA_WHEEL']} (~250 MB)", flush=True)
        ok, err = pip_download(pip, [f"{pin['CUDA_WHEEL_PROJECT']}=={pin['VERSION']}"], wheels)
        if not ok or not whl.exists():
            raise RuntimeError(f"the registry did not provide {whl.name}: {err[-500:]}")
    got = sha256_of(whl)
    if got != pin["CUDA_WHEEL_SHA256"]:
        raise RuntimeError(f"sha256 mismatch for {whl}: expected {pin['CUDA_WHEEL_SHA256']}, got {got}")
    return whl


def wheel_version(filename: str) -> str:
    return filename.split("-")[1]


def _join_spec(*specs: str) -> str:
    return ",".join(c for sp in specs for c in sp.strip().strip("()").split(",") if c.strip())


def conflicts(metadata: str, got: dict[str, Path], extras: dict[str, set], have: dict
              ) -> list[tuple[str, str, str, str]]:
    """(requirer, name, spec, version) for every requirement of vLLM (`metadata`) or of a carried
    wheel that the carried (or the machine's known) version of `name` does not meet."""
    versions = {n: wheel_version(p.name) for n, p in got.items()}
    out = []
    for requirer, meta in [("vllm", metadata)] + [(n, wheel_metadata(p)) for n, p in got.items()]:
        for line in requires_dist(meta):
            req = parse_requirement(line)
            if not eval_marker(req["marker"], TARGET_ENV, tuple(sorted(extras.get(requirer, ())))):
                continue
            version = versions.get(req["name"]) or have.get(req["name"])
            if version and not spec_satisfied(version, req["spec"]):
                out.append((requirer, req["name"], req["spec"], version))
    return out


def collect(pip: list[str], metadata: str, have: dict, skip: set, deps_dir: Path
            ) -> tuple[dict[str, Path], list[str]]:
    """The wheels (project -> file in `deps_dir`, cached there) of every requirement of
    `metadata` the machine lacks, and theirs in turn; and what could not be downloaded.
    pip download --no-deps takes each requirement alone, so a wheel can need another version of
    a project than the one carried (xgrammar 0.2.8 wants apache-tvm-ffi>=0.1.11, vLLM 0.25.1 pins
    0.1.9): then the wheel that asks is taken one version lower (xgrammar 0.2.3), as pip's
    resolver would, until every requirement is met; a pin of vLLM's own is imposed on the project.
    The machine's packages of known version (`--have`) are fixed: a wheel whose requirement they
    miss steps down too (xgrammar 0.2.5 wants transformers<5, the H200 has 5.17.0)."""
    bounds: dict[str, str] = {}  # project -> extra specifier from a conflict
    previous: dict[str, Path] = {}  # project -> its wheel before the first conflict that redid it
    accepted: set[tuple[str, str]] = set()  # (requirer, project) conflicts left as they are
    first_req: dict[str, tuple[dict, str]] = {}
    got: dict[str, Path] = {}
    extras_done: dict[str, set] = {}
    failed: list[str] = []

    def accept(requirer: str, name: str, why: str) -> None:
        accepted.add((requirer, name))
        print(f"  warning: {why}; left as it is (pip would refuse this set; the checks do not "
              "import it, or import it lazily)", file=sys.stderr, flush=True)

    queue = [(r, "vllm") for r in needed(metadata, (), have, skip)[0]]
    for _round in range(30):
        while queue:
            req, by = queue.pop(0)
            name = req["name"]
            first_req.setdefault(name, (req, by))
            new_extras = set(req["extras"]) - extras_done.get(name, set())
            if name in got and not new_extras:
                continue
            if name not in got:
                spec = _join_spec(req["spec"], bounds.get(name, ""))
                fits = [p for p in deps_dir.glob("*.whl") if wheel_project(p.name) == name
                        and spec_satisfied(wheel_version(p.name), spec)]
                before = set(deps_dir.glob("*.whl"))
                err = ""
                if not fits:
                    ok, err = pip_download(pip, [f"{name}{spec}" if not spec or spec[0] in "<>=!~"
                                                 else f"{name} {spec}"], deps_dir)
                new = fits or [p for p in set(deps_dir.glob("*.whl")) - before
                               if wheel_project(p.name) == name]
                if not new and name in previous:  # no version steps down far enough: the first
                    got[name] = previous.pop(name)
                    bounds.pop(name, None)
                    extras_done.setdefault(name, set()).update(req["extras"])
                    for c in conflicts(metadata, got, extras_done, have):
                        if c[0] == name:
                            accept(c[0], c[1], f"{name} {wheel_version(got[name].name)} needs "
                                   f"{c[1]}{c[2]} (carried or on the machine: {c[3]}), and no "
                                   f"{name}{spec} came")
                    continue
                if not new:
                    failed.append(f"{name}{spec} (for {by}): "
                                  f"{(err.splitlines() or ['no wheel came'])[-1]}")
                    continue
                got[name] = max(new, key=lambda p: pep440_key(wheel_version(p.name)))
                print(f"  {got[name].name}  (for {by})", flush=True)
            extras_done.setdefault(name, set()).update(req["extras"])
            more, _, _ = needed(wheel_metadata(got[name]), tuple(sorted(extras_done[name])), have, skip)
            # the machine's packages stay as they are for a dependency's sake (its transformers,
            # torch): a version they do not meet is a conflict of the wheel that asks
            more = [r for r in more if have.get(r["name"]) is None]
            queue.extend((r, name) for r in more if r["name"] not in got or r["extras"])
        if failed:
            return got, failed
        found = [c for c in conflicts(metadata, got, extras_done, have) if c[:2] not in accepted]
        if not found:
            return got, failed
        redone: set[str] = set()
        for requirer, name, spec, version in found:
            if requirer == "vllm":  # vLLM's pin wins over another wheel's choice
                if name not in got:
                    accept(requirer, name, f"vLLM needs {name}{spec}, the machine has {version}")
                    continue
                target, bound = name, spec
            elif "==" in first_req[requirer][0]["spec"]:  # pinned: cannot step down
                if have.get(requirer) is not None:  # the machine has its own, which fits
                    print(f"  warning: {requirer}{first_req[requirer][0]['spec']} (for "
                          f"{first_req[requirer][1]}) needs {name}{spec}, the machine has "
                          f"{version}: not carried, the machine's {requirer} "
                          f"{have[requirer]} kept", file=sys.stderr, flush=True)
                    got.pop(requirer, None)
                    extras_done.pop(requirer, None)
                    redone.add(requirer)
                    continue
                accept(requirer, name, f"{requirer}{first_req[requirer][0]['spec']} (for "
                       f"{first_req[requirer][1]}) needs {name}{spec}, carried or on the machine: "
                       f"{version}")
                continue
            else:  # the wheel that asks for another version steps down one version
                target, bound = requirer, f"<{wheel_version(got[requirer].name)}"
            if target in redone:
                continue
            redone.add(target)
            print(f"  conflict: {requirer} needs {name}{spec}, carried or on the machine {version}:"
                  f" {target} taken again with {bound}", flush=True)
            bounds[target] = _join_spec(bounds.get(target, ""), bound)
            previous.setdefault(target, got.pop(target))
            req, by = first_req[target]
            queue.append((dict(req, extras=sorted(extras_done.pop(target, set()) | set(req["extras"]))), by))
    failed.append("conflicting requirements not resolved after 30 rounds: " +
                  "; ".join(f"{r} needs {n}{s} (carried {v})"
                            for r, n, s, v in conflicts(metadata, got, extras_done, have)))
    return got, failed


def cmd_pack(args) -> int:
    from kvstack.release.pins import cache_dir, load_pin

    pin = load_pin("vllm").values  # the base in effect ($KVSTACK_BASE, else vllm/default)
    wheels = args.wheels or cache_dir() / "wheels"
    deps_dir = args.wheels_deps or cache_dir() / "wheels-cp312"
    if args.have is None and MACHINE_PACKAGES.exists():
        args.have = MACHINE_PACKAGES
    have = read_have(args.have)
    skip = ({norm(n) for n in DEFAULT_SKIP} | {norm(n) for n in args.skip}) - {norm(n) for n in args.with_}
    pip = args.pip.split() if args.pip else [sys.executable, "-m", "pip"]
    piece_bytes = int(args.piece_mib * 2**20)

    try:
        meta, source = vllm_metadata(args, pin, wheels)
    except FileNotFoundError:
        if args.dry_run:
            print("error: no METADATA for vLLM: neither the cached CUDA wheel nor vllm/src/<base>/"
                  "PKG-INFO is there; run scripts/fetch_sources.sh or pass --metadata", file=sys.stderr)
            return 2
        meta, source = None, None
    from kvstack.release.pins import default_base

    base = default_base()
    why = torch_mismatch(meta, have, base) if meta is not None else None
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 1
    if args.dry_run:
        carry, there, skipped = needed(meta, (), have, skip)
        state = "cached" if (wheels / pin["CUDA_WHEEL"]).exists() else "to download"
        print(f"vLLM wheel: {pin['CUDA_WHEEL']} sha256 {pin['CUDA_WHEEL_SHA256']} ({state}, "
              f"{wheels})")
        print(f"requirements from {source}; the machine's packages: "
              f"{args.have or 'DEFAULT_HAVE (2026-11-17)'}")
        print(f"there already ({len(there)}): " + " ".join(r["name"] for r in there))
        print(f"skipped, optional ({len(skipped)}): " + " ".join(r["name"] for r in skipped))
        print(f"would download ({len(carry)}), cp312 manylinux wheels, --no-deps:")
        for r in carry:
            print(f"  {r['name']}{'[' + ','.join(r['extras']) + ']' if r['extras'] else ''}"
                  f"{r['spec']}")
        print("then the requirements of each downloaded wheel the machine lacks, the same way; "
              f"then pieces of <= {args.piece_mib:g} MiB in {args.out}/NNN/")
        return 0

    wheels.mkdir(parents=True, exist_ok=True)
    deps_dir.mkdir(parents=True, exist_ok=True)
    try:
        vllm_whl = fetch_vllm(pip, pin, wheels)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{vllm_whl.name}: sha256 ok", flush=True)
    why = torch_mismatch(wheel_metadata(vllm_whl), have, base)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 1
    got, failed = collect(pip, wheel_metadata(vllm_whl), have, skip, deps_dir)
    if failed:
        print("error: could not download:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    files = [vllm_whl] + [got[n] for n in sorted(got)]
    manifest = split_into_folders(files, args.out, piece_bytes, base=base)
    total = sum(e["size"] for e in manifest["files"])
    print(f"{len(files)} wheels, {total / 2**20:.0f} MiB, in {len(manifest['folders'])} folder(s) "
          f"of <= {args.piece_mib:g} MiB under {args.out} (manifest {manifest['id']})")
    tree = tree_bytes()
    if tree is not None:
        biggest = max(sum(p["size"] for e in manifest["files"] for p in e["pieces"]
                          if p["folder"] == f) for f in manifest["folders"])
        print(f"a call carries one folder (<= {biggest / 2**20:.1f} MiB) + the working tree "
              f"({tree / 2**20:.1f} MiB) = {(biggest + tree) / 2**20:.1f} MiB of {CALL_LIMIT_MIB}")
        if biggest + tree > (CALL_LIMIT_MIB - CALL_MARGIN_MIB) * 2**20:
            print(f"warning: over the limit of one call less a {CALL_MARGIN_MIB:g} MiB margin (the run "
                  "tool counts more than the bytes): pack again with a smaller --piece-mib",
                  file=sys.stderr)
    rel = args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out
    print("run calls, one right after the other (the machine goes back after ~30 s idle):")
    for i, folder in enumerate(manifest["folders"]):
        extra = " && python3 -m pip list --format=freeze > $OUT/have.txt" if i == 0 else ""
        print(f"  carry [\"{rel}/{folder}\"]  command: python3 ci/gpu/carry.py unpack "
              f"{rel}/{folder}{extra}")
    print(f"  command: export KVSTACK_BASE={base}; bash ci/gpu/run_checks.sh --layout-s 180 "
          "--streaming-s 300   (timeout_s 600; install, both checks, logs in $OUT)")
    return 0


# ----------------------------------------------------------------------------- plan

# Device seconds of each part of a session, from the H200 run of 2026-11-27 (ci/gpu/README.md): a
# fresh machine's start with the first unpack call (30 s held), one more unpack call (~6 s each,
# 62 MiB carried), then the last call's steps as first_run.sh timed them (443 s in all); the floor
# bench 33 s then, 50 s on 2026-11-30 (26 s of it allocating its tier, since cut to 7 s), 45 s
# expected with the connector variant (--decode stream,connector).
PLAN_SECONDS = {"start": 30, "unpack": 6, "floor bench": 45, "install": 70, "check_layout": 141,
                "check_streaming": 201, "check_scratch": 130, "shuffled bench": 60}
# call 8, on the same warm machine, outside the 10-minute first job: the device scratch check
# (issue 28; its import check and three engines took 129 s on 2026-11-27, 116 s on 2026-11-30),
# then the floor bench over scattered pages, where a window is ~2,048 runs: gathered by our
# kernel (kvstack/streaming/gather.py) against 8.98x / 8.37x of the floor copied run by run
# (one H200, 2026-11-30)
SHUFFLED_BENCH_ARGS = ("--contexts 128K --page-order shuffled --decode-batch 1,4 "
                       "--decode stream,connector --reps 2")
SCRATCH_CALL = ("bash ci/gpu/run_checks.sh --no-install --skip-layout --skip-streaming "
                "--scratch-s 150; timeout 90 python3 bench/streaming_gpu.py "
                f"{SHUFFLED_BENCH_ARGS} > $OUT/floor-bench-shuffled.log 2>&1; "
                "grep -E '^(gather|RESULT)' $OUT/floor-bench-shuffled.log")
SESSION_BUDGET_S = 900
PLAN_TARGET_S = 600  # the last call must fit one `run` call; the session's budget is 900 s
ASSUMED_FOLDERS = 6  # the pack of 2026-11-26 (base 0.25), when none is packed here


def cmd_plan(args) -> int:
    """The `run` calls of a GPU session in order, their carry and expected device time."""
    manifest = None
    first = args.out / "000" / "manifest.json"
    if first.is_file():
        manifest = json.loads(first.read_text())
    tree = tree_bytes() or 0
    limit = (CALL_LIMIT_MIB - CALL_MARGIN_MIB) * 2**20
    rel = args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out
    ok = True
    if manifest is None:
        folders = [(f"{i:03d}", None) for i in range(ASSUMED_FOLDERS)]
        print(f"no carry packed in {rel}: `KVSTACK_BASE=0.25 python3 ci/gpu/carry.py pack` first "
              f"(assumed here: {ASSUMED_FOLDERS} folders, as packed on 2026-11-26)")
    else:
        folders = [(f, sum(pc["size"] for e in manifest["files"] for pc in e["pieces"]
                           if pc["folder"] == f)) for f in manifest["folders"]]
        print(f"carry packed in {rel} (manifest {manifest['id']}, base {manifest.get('base')}): "
              f"{len(manifest['files'])} files in {len(folders)} folders")
    print(f"working tree sent with every call: {tree / 2**20:.1f} MiB; a call may carry "
          f"{limit / 2**20:.1f} MiB ({CALL_LIMIT_MIB} less a {CALL_MARGIN_MIB:g} MiB margin)")
    total = PLAN_SECONDS["start"]
    print(f"  start of a fresh machine: ~{PLAN_SECONDS['start']} s")
    for i, (folder, size) in enumerate(folders):
        extra = " && python3 -m pip list --format=freeze > $OUT/have.txt" if i == 0 else ""
        if size is None:
            mib = f"<= {PIECE_MIB} MiB"
        else:
            mib = f"{size / 2**20:.1f} MiB + tree = {(size + tree) / 2**20:.1f} MiB"
            if size + tree > limit:
                ok = False
                mib += " OVER THE LIMIT"
        print(f"  call {i + 1}: carry [\"{rel}/{folder}\"] ({mib}): python3 ci/gpu/carry.py unpack "
              f"{rel}/{folder}{extra}   ~{PLAN_SECONDS['unpack']} s")
        total += PLAN_SECONDS["unpack"]
    limits = args.bench_s + PLAN_SECONDS["install"] + args.layout_s + args.streaming_s
    steps = ("floor bench", "install", "check_layout", "check_streaming")
    expect = sum(min(PLAN_SECONDS[s], lim) for s, lim in zip(steps, (
        args.bench_s, PLAN_SECONDS["install"], args.layout_s, args.streaming_s)))
    print(f"  call {len(folders) + 1}: bash ci/gpu/first_run.sh   (timeout_s 600; limits: floor bench "
          f"{args.bench_s} s [python3 bench/streaming_gpu.py {args.bench_args}], install ~"
          f"{PLAN_SECONDS['install']} s, check_layout {args.layout_s} s, check_streaming "
          f"{args.streaming_s} s = {limits} s)   ~{expect} s")
    total += expect
    if limits > PLAN_TARGET_S:
        ok = False
        print(f"error: the last call's limits add up to {limits} s, over one call's {PLAN_TARGET_S} s")
    scratch = PLAN_SECONDS["check_scratch"] + PLAN_SECONDS["shuffled bench"]
    print(f"  call {len(folders) + 2} (right after, same machine; not in the first job): "
          f"{SCRATCH_CALL}   (timeout_s 270)   ~{scratch} s")
    print(f"  then: copy $OUT's summary.log, floor-bench.log and check logs into ci/gpu/results/ and "
          "the figures into docs/streaming-gpu.md and the README; give_back")
    print(f"DEVICE TIME expected {total} s ({total / 60:.1f} min) of the {PLAN_TARGET_S // 60}-minute "
          f"target (at most {PLAN_SECONDS['start'] + len(folders) * PLAN_SECONDS['unpack'] + limits} s "
          "with every step at its limit); a session's device budget is 900 s")
    if total > PLAN_TARGET_S:
        ok = False
        print("error: the plan overruns its target")
    print(f"with call {len(folders) + 2}: {total + scratch} s of the session's {SESSION_BUDGET_S} s")
    if total + scratch > SESSION_BUDGET_S:
        ok = False
        print("error: the session's calls overrun its device budget")
    return 0 if ok else 1


# ----------------------------------------------------------------------------- there

def cmd_unpack(args) -> int:
    folder = args.folder
    if not (folder / MANIFEST).exists():
        print(f"error: {folder} holds no {MANIFEST}; carry a folder made by `carry.py pack`",
              file=sys.stderr)
        return 2
    manifest = json.loads((folder / MANIFEST).read_text())
    state_file = args.dest / "state.json"
    fresh = not state_file.exists() or json.loads(state_file.read_text()).get("id") != manifest["id"]
    ok, lines = unpack_folder(folder, args.dest)
    if fresh and folder.name != manifest["folders"][0]:
        lines.append(f"note: {args.dest} held none of this pack before: if earlier folders were "
                     "unpacked, the machine was given back in between (a fresh one is bare); "
                     f"start again from {manifest['folders'][0]}")
    print("\n".join(lines))
    return 0 if ok else 1


IMPORT_CHECK = """
import importlib, sys
bad = []
for m in ("vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.worker.gpu_model_runner",
          "vllm.model_executor.models.llama4", "vllm.v1.attention.backends.flash_attn",
          "vllm.vllm_flash_attn", "kvstack.streaming"):
    try:
        importlib.import_module(m)
    except Exception as e:
        bad.append(f"{m}: {type(e).__name__}: {e}")
try:
    from vllm.platforms import current_platform
    if not current_platform.is_cuda():
        bad.append(f"vLLM's platform is {type(current_platform).__name__}, not CUDA")
except Exception as e:
    bad.append(f"vllm.platforms: {type(e).__name__}: {e}")
print("import check: " + ("ok" if not bad else "FAILED\\n  " + "\\n  ".join(bad)))
sys.exit(1 if bad else 0)
"""


PARENT_SITE = "import json, site, sys; print(json.dumps([sys.prefix != sys.base_prefix, site.getsitepackages()]))"


def cmd_install(args) -> int:
    manifest, incomplete = carried_status(args.dest)
    if manifest is None:
        print(f"error: {args.dest} holds nothing carried; run `carry.py unpack` for each folder "
              "first (on this machine: a fresh one is bare)", file=sys.stderr)
        return 1
    if incomplete:
        print(f"error: not complete yet: {', '.join(incomplete)}", file=sys.stderr)
        return 1
    if not args.no_patches and shutil.which("git") is None:
        print("error: kvstack's patch stack is applied with `git apply`, and git is not on PATH",
              file=sys.stderr)
        return 1
    wheels = [args.dest / "files" / e["name"] for e in manifest["files"]]
    venv = args.venv
    py = venv / "bin" / "python"

    def step(what, cmd, **kw):
        print(f"== {what}", flush=True)
        res = subprocess.run(cmd, **kw)
        if res.returncode:
            print(f"error: {what} failed (exit {res.returncode})", file=sys.stderr)
        return res.returncode == 0

    if not py.exists():
        # --without-pip: the machine's python may lack ensurepip; its own pip installs (--python)
        if not step(f"venv {venv} (--system-site-packages)",
                    [args.python, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)]):
            return 1
        # The machine's python3 is itself a venv (/opt/torch/.venv): --system-site-packages
        # would show the base interpreter's packages, not its torch. A .pth adds its site-packages.
        is_venv, parent_sites = json.loads(subprocess.run(
            [args.python, "-c", PARENT_SITE], capture_output=True, text=True, check=True).stdout)
        if is_venv:
            site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip()
            Path(site, "zz_kvstack_parent_site.pth").write_text("\n".join(parent_sites) + "\n")
            print(f"   {args.python} is a venv: its site-packages added ({', '.join(parent_sites)})")
    if not step(f"pip install --no-index --no-deps {len(wheels)} wheels",
                [args.python, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-index",
                 "--no-deps", "--no-cache-dir", *map(str, wheels)]):
        return 1
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True).stdout.strip()
    env = dict(os.environ, PYTHON=str(py))
    if manifest.get("base"):
        env["KVSTACK_BASE"] = manifest["base"]  # the base whose vLLM was packed
    if not args.no_patches and not step(f"kvstack's patch stack on {site}",
                                        ["bash", str(ROOT / "scripts" / "apply_patches.sh"),
                                         "--site-packages", site, "--component", "vllm", "-q"],
                                        env=env):
        return 1
    if args.no_check:
        return 0
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if not step("import check", [str(py), "-c", IMPORT_CHECK], env=env):
        return 1
    cli = venv / "bin" / "vllm"
    version = [str(cli)] if cli.exists() else [str(py), "-m", "vllm.entrypoints.cli.main"]
    return 0 if step("vllm --version", [*version, "--version"]) else 1


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring or ci/gpu/README.md for the run calls.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="(here) download and split into build/gpu-carry/NNN")
    p.add_argument("--dry-run", action="store_true", help="list what would be downloaded; no network")
    p.add_argument("--have", type=Path, help="`python3 -m pip list --format=freeze` of the machine "
                   "(default ci/gpu/machine-packages.txt, else the names of DEFAULT_HAVE)")
    p.add_argument("--metadata", type=Path, help="vLLM's METADATA/PKG-INFO to read requirements from")
    p.add_argument("--skip", action="append", default=[], metavar="NAME", help="do not carry NAME")
    p.add_argument("--with", dest="with_", action="append", default=[], metavar="NAME",
                   help="carry NAME although DEFAULT_SKIP lists it")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    p.add_argument("--piece-mib", type=float, default=PIECE_MIB, help=f"default {PIECE_MIB}")
    p.add_argument("--wheels", type=Path, help="cache of the vLLM wheel (default ~/.cache/kvstack/wheels)")
    p.add_argument("--wheels-deps", type=Path,
                   help="cache of the cp312 dependency wheels (default ~/.cache/kvstack/wheels-cp312)")
    p.add_argument("--pip", help="pip command (default: this python -m pip)")
    pl = sub.add_parser("plan", help="(here) the session's run calls and their device time "
                        "(ci/gpu/first_run.sh --dry-run)")
    pl.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the packed carry (default {DEFAULT_OUT})")
    pl.add_argument("--bench-s", type=int, default=75)  # first_run.sh's limits
    pl.add_argument("--layout-s", type=int, default=165)
    pl.add_argument("--streaming-s", type=int, default=270)
    pl.add_argument("--bench-args", default="")
    u = sub.add_parser("unpack", help="(there) take one carried folder into --dest")
    u.add_argument("folder", type=Path)
    u.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"default {DEFAULT_DEST}")
    i = sub.add_parser("install", help="(there) venv + wheels + patch stack + vllm --version")
    i.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"default {DEFAULT_DEST}")
    i.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"default {DEFAULT_VENV}")
    i.add_argument("--python", default="python3", help="the machine's python (has torch)")
    i.add_argument("--no-patches", action="store_true", help="skip kvstack's patch stack")
    i.add_argument("--no-check", action="store_true", help="skip the import check and vllm --version")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        if args.piece_mib <= 0 or args.piece_mib > CALL_LIMIT_MIB:
            ap.error(f"--piece-mib must be in (0, {CALL_LIMIT_MIB}]")
        args.out = args.out.resolve()
        return cmd_pack(args)
    if args.cmd == "plan":
        args.out = args.out.resolve()
        return cmd_plan(args)
    if args.cmd == "unpack":
        return cmd_unpack(args)
    return cmd_install(args)


if __name__ == "__main__":
    sys.exit(main())
