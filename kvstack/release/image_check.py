"""Checks run inside a built kvstack image, without a GPU (issue 31): what a user's first commands
need, and nothing left behind that must not ship.

    python -m kvstack.release.image_check [--target cuda|cpu] [--model DIR] [--sizes]

One line per check (``[ok]`` / ``[FAIL]``), then ``RESULT n/m checks hold``; exit 0 when all hold,
1 otherwise. ``kvstack doctor`` (every patch applied, pins) is run by the caller beside it.

- ``vllm --version`` is the pinned vLLM; ``vllm serve --help`` and ``--help=kv-transfer-config``
  answer (vLLM patch 0014 where there is no GPU);
- torch, vLLM and LMCache import; for cuda torch is a CUDA build (``torch.version.cuda``);
- kvstack's StreamingConnector, LMCacheConnectorV1 and MultiConnector resolve by name through
  vLLM's connector factory (what ``--kv-transfer-config`` does);
- cuda: LMCache's CUDA extension is there and loads after torch (failing at most on the driver,
  ``libcuda``, the host's at run time);
- nothing left behind: no pip or kvstack download cache, no wheelhouse, no CA bundle from the build's
  secret, no copy of the build context's bind mounts (``/tmp/kvstack-context``);
- the SBOM and the image metadata are where the labels say;
- with ``--model``: ``vllm serve`` without a GPU (cuda) fails with vLLM's own "Failed to infer
  device type" (or torch's "no GPU"), never an ``ImportError`` or a traceback of our own;
- with ``--sizes``: first the ten biggest directories (``SIZE ... MiB path``; one level below ``/``,
  the venv's site-packages and its ``nvidia/``).
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

VENV = Path(os.environ.get("KVSTACK_VENV", "/opt/kvstack"))
# How a start without a device ends: vLLM's platform inference ("Failed to infer device type", vLLM
# 0.32.0 with kvstack's patch 0014) or torch's CUDA initialisation.
NO_DEVICE_ERRORS = ("Failed to infer device type", "No CUDA GPUs are available",
                    "Found no NVIDIA driver")
SHARE = VENV / "share" / "kvstack"


def _run(*cmd: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)


def check_versions(target: str) -> list[tuple[str, bool, str]]:
    meta = json.loads((SHARE / "image.json").read_text())
    want = meta.get("labels", {}).get("kvstack.pin.vllm.version")
    res = _run("vllm", "--version")
    got = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr.strip()[-200:]
    out = [("vllm --version", res.returncode == 0 and (want is None or got == want),
            f"{got} (pin {want})")]
    res = _run("vllm", "serve", "--help")
    out.append(("vllm serve --help", res.returncode == 0 and "usage: vllm serve" in res.stdout,
                f"exit {res.returncode}"))
    # the flag our connectors are given through (its own help page: `--help` lists the groups only)
    res = _run("vllm", "serve", "--help=kv-transfer-config")
    out.append(("vllm serve --help=kv-transfer-config",
                res.returncode == 0 and "--kv-transfer-config" in res.stdout, f"exit {res.returncode}"))
    return out


def check_imports(target: str) -> list[tuple[str, bool, str]]:
    out = []
    for mod in ("torch", "vllm", "lmcache", "kvstack.streaming"):
        try:
            m = importlib.import_module(mod)
            out.append((f"import {mod}", True, getattr(m, "__version__", "") or "ok"))
        except Exception as e:  # noqa: BLE001 - the check reports whatever broke
            out.append((f"import {mod}", False, f"{type(e).__name__}: {e}"[:300]))
    if target == "cuda":
        import torch

        out.append(("torch is a CUDA build", bool(torch.version.cuda),
                    f"torch {torch.__version__}, CUDA {torch.version.cuda}"))
    return out


def check_connectors() -> list[tuple[str, bool, str]]:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    out = []
    for name, path in (("StreamingConnector", "kvstack.streaming"), ("LMCacheConnectorV1", None),
                       ("MultiConnector", None)):
        try:
            ktc = KVTransferConfig(kv_connector=name, kv_role="kv_both",
                                   kv_connector_module_path=path)
            cls = KVConnectorFactory.get_connector_class(ktc)
            out.append((f"connector {name}", True, f"{cls.__module__}.{cls.__name__}"))
        except Exception as e:  # noqa: BLE001
            out.append((f"connector {name}", False, f"{type(e).__name__}: {e}"[:300]))
    return out


def check_lmcache_cuda() -> list[tuple[str, bool, str]]:
    """LMCache's CUDA extension is there and loads: imported after torch (which loads the CUDA
    runtime and its own libraries from the wheels, as at run time; `ldd` alone cannot see them),
    failing at most on the driver (libcuda, the host's at run time)."""
    import lmcache
    import torch  # noqa: F401

    root = Path(lmcache.__file__).parent
    # LMCache 0.5.6 names it cuda_ops (earlier releases c_ops)
    exts = sorted(glob.glob(str(root / "cuda_ops*.so")) + glob.glob(str(root / "c_ops*.so")))
    if not exts:
        return [("LMCache CUDA extension", False, f"no cuda_ops*.so / c_ops*.so under {root}")]
    name = Path(exts[0]).name.split(".")[0]
    try:
        importlib.import_module(f"lmcache.{name}")
    except ImportError as exc:
        ok = "libcuda.so" in str(exc)
        return [("LMCache CUDA extension", ok, f"{Path(exts[0]).name}: {exc}" +
                 (" (the host driver's, at run time)" if ok else ""))]
    return [("LMCache CUDA extension", True, f"{Path(exts[0]).name} loads after torch")]


def check_left_behind() -> list[tuple[str, bool, str]]:
    home = Path.home()
    found = []
    for pattern in (home / ".cache" / "pip", home / ".cache" / "kvstack", Path("/wheelhouse"),
                    Path("/run/secrets/pip_cert"), Path("/tmp/kvstack-context")):
        p = Path(pattern)
        if p.exists() and (p.is_file() or any(p.iterdir())):
            found.append(str(p))
    return [("nothing left behind (caches, wheelhouse, CA bundle)", not found,
             ", ".join(found) if found else "none of them in the image")]


def check_metadata() -> list[tuple[str, bool, str]]:
    out = []
    for name in ("sbom.pip-inspect.json", "image.json"):
        p = SHARE / name
        ok = p.is_file() and p.stat().st_size > 0
        if ok:
            try:
                json.loads(p.read_text())
            except ValueError:
                ok = False
        out.append((f"{name}", ok, str(p)))
    return out


def check_serve_without_gpu(model: str) -> list[tuple[str, bool, str]]:
    try:
        res = _run("vllm", "serve", model, "--max-model-len", "256", "--port", "18123",
                   "--host", "127.0.0.1", timeout=240)
        text, code = res.stdout + res.stderr, res.returncode
    except subprocess.TimeoutExpired as e:
        text, code = f"{e.stdout or ''}{e.stderr or ''}", "timeout"
    text = text if isinstance(text, str) else text.decode(errors="replace")
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "")
    # the exception it ends with must be vLLM's own "no device" error (vLLM's CUDA wheel also warns
    # "Failed to import from vllm._C: ModuleNotFoundError" on every start, GPU or not: not the failure)
    clear = any(msg in last for msg in NO_DEVICE_ERRORS)
    return [("vllm serve without a GPU fails with vLLM's own error", code not in (0, "timeout") and clear,
             f"exit {code}: {last.strip()[:240]}")]


def biggest_dirs(roots: list[str], count: int = 10) -> list[tuple[int, str]]:
    """The `count` biggest directories one level below each of `roots` (bytes, path), as `du -x`
    counts them (a folder and its parent may both be listed when both are among the biggest)."""
    sizes = {}
    for root in roots:
        if not Path(root).is_dir():
            continue
        res = _run("du", "-x", "-B1", "--max-depth=1", root, timeout=600)
        for line in res.stdout.splitlines():
            size, _, path = line.partition("\t")
            if size.isdigit() and path.rstrip("/") != root.rstrip("/"):
                sizes[path] = int(size)
    return sorted(((v, k) for k, v in sizes.items()), reverse=True)[:count]


def size_roots() -> list[str]:
    """Where an image's size goes: the root, the venv's site-packages and its nvidia/ (the CUDA
    libraries)."""
    site = sorted(glob.glob(str(VENV / "lib" / "python3*" / "site-packages")))
    return ["/", *site, *(str(Path(s) / "nvidia") for s in site)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", help="a model folder for the `vllm serve` check (cuda: must fail "
                                    "without a GPU with vLLM's own message)")
    ap.add_argument("--sizes", action="store_true",
                    help="first print the ten biggest directories (one level below /, the venv's "
                         "site-packages and its nvidia/)")
    args = ap.parse_args(argv)
    if args.sizes:
        for size, path in biggest_dirs(size_roots()):
            print(f"SIZE {size / 2**20:9.0f} MiB  {path}", flush=True)
    checks = check_versions(args.target) + check_imports(args.target) + check_connectors()
    if args.target == "cuda":
        checks += check_lmcache_cuda()
    checks += check_left_behind() + check_metadata()
    if args.model and args.target == "cuda":
        checks += check_serve_without_gpu(args.model)
    for name, ok, detail in checks:
        print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)
    bad = [n for n, ok, _ in checks if not ok]
    print(f"RESULT {len(checks) - len(bad)}/{len(checks)} checks hold"
          + (f"; failing: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
