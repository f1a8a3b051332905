#!/usr/bin/env python3
"""The container image's metadata, computed from one base's pin files and patch series (never typed twice).

    scripts/image_labels.py [--base NAME] [--target cuda|cpu] [--format labels|json] [--site-packages DIR]
                            [--revision SHA] [--source URL] [--out FILE]

--base NAME      the kvstack base the image is built on (vllm/NAME.env, lmcache/NAME.env,
                 patches/NAME/); default $KVSTACK_BASE, else vllm/default

--format labels  one KEY=VALUE line per image label (scripts/docker_build.sh passes each as --label)
--format json    the same labels plus the patch list as a JSON object (install_image.sh writes it into
                 the image as /opt/kvstack/share/kvstack/image.json)
--site-packages  also record, per patch, its state in that installed site-packages ("already applied",
                 or "nothing installed to patch" for a patch of upstream tests/ only, is what a good
                 image has), read the way `kvstack doctor` reads it

Labels: org.opencontainers.image.{title,description,licenses,version,source,revision},
kvstack.target, kvstack.base (the base's name), kvstack.base.label (e.g. "0.25 (vLLM 0.25.1 + LMCache
0.5.3)"), kvstack.torch.version (the torch the target installs), kvstack.pin.<component>.<key> for every KEY=VALUE of vllm/<base>.env and
lmcache/<base>.env (keys lower-cased, '_' -> '-'), kvstack.patches (JSON list: component, patch, subject, upstream status),
kvstack.patches.count, kvstack.sbom (path of the pip-inspect SBOM inside the image).
Exit codes: 0 ok, 2 usage error (an unknown base included).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvstack.release.patchstack import patch_headers, read_series  # noqa: E402
from kvstack.release.pins import COMPONENTS, default_base, load_base, load_pin  # noqa: E402

SBOM_PATH = "/opt/kvstack/share/kvstack/sbom.pip-inspect.json"
TARGETS = ("cuda", "cpu")


def project_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
    return m.group(1) if m else "unknown"


def upstream_status(patch: Path) -> str:
    text = patch.read_text(errors="replace")
    body = text.split("\n\n", 1)[1].split("\n---\n", 1)[0] if "\n\n" in text else ""
    m = re.search(r"^Upstream-Status:\s*(.+)$", body, re.M)
    return m.group(1).strip() if m else "unknown"


def patch_list(site_packages: Path | None = None, base: str | None = None) -> list[dict]:
    out = []
    for comp in COMPONENTS:
        patches = read_series(load_pin(comp, base).series_dir)
        states: dict[Path, str] = {}
        if site_packages is not None and patches:
            from kvstack.release.patchstack import plan_series

            plan = plan_series(comp, patches, site_packages, installed_only=True)
            try:
                states = {r.patch: r.state for r in plan.results}
            finally:
                plan.cleanup()
        for p in patches:
            subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", " ".join(str(patch_headers(p)["Subject"] or "").split()))
            entry = {"component": comp, "patch": p.name, "subject": subject, "upstream_status": upstream_status(p)}
            if site_packages is not None:
                entry["state"] = states.get(p, "unknown")
            out.append(entry)
    return out


def labels(target: str, revision: str, source: str, patches: list[dict], base: str | None = None) -> dict[str, str]:
    base = base or default_base()
    lab = {
        "org.opencontainers.image.title": f"kvstack ({target}, base {base})",
        "org.opencontainers.image.description": "vLLM + LMCache with the kvstack patch stack applied; entrypoint: vllm serve",
        "org.opencontainers.image.licenses": "Apache-2.0",
        "org.opencontainers.image.version": project_version(),
        "org.opencontainers.image.revision": revision,
        "org.opencontainers.image.source": source,
        "kvstack.target": target,
        "kvstack.base": base,
        "kvstack.base.label": load_base(base).label,
    }
    # the torch the target installs: the cuda target's CUDA build where the pins carry one beside the
    # cpu venv's +cpu build (CUDA_TORCH_VERSION), else TORCH_VERSION
    vllm_pins = load_pin("vllm", base).values
    lab["kvstack.torch.version"] = ((vllm_pins.get("CUDA_TORCH_VERSION") if target == "cuda" else None)
                                    or vllm_pins.get("TORCH_VERSION", ""))
    for comp in COMPONENTS:
        for key, value in load_pin(comp, base).values.items():
            lab[f"kvstack.pin.{comp}.{key.lower().replace('_', '-')}"] = value
    lab["kvstack.patches"] = json.dumps(
        [{k: v for k, v in p.items() if k != "state"} for p in patches], separators=(",", ":"))
    lab["kvstack.patches.count"] = str(len(patches))
    lab["kvstack.sbom"] = SBOM_PATH
    return lab


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/image_labels.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="the kvstack base (default: $KVSTACK_BASE, else vllm/default)")
    ap.add_argument("--target", choices=TARGETS, default="cuda")
    ap.add_argument("--format", choices=("labels", "json"), default="labels")
    ap.add_argument("--site-packages", type=Path)
    ap.add_argument("--revision", default="unknown")
    ap.add_argument("--source", default="")
    ap.add_argument("--out", type=Path, help="write here instead of stdout")
    args = ap.parse_args(argv)
    if args.site_packages is not None and not args.site_packages.is_dir():
        print(f"error: {args.site_packages} is not a directory", file=sys.stderr)
        return 2
    try:
        base = args.base or default_base()
        load_base(base)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    patches = patch_list(args.site_packages, base)
    lab = labels(args.target, args.revision, args.source, patches, base)
    for k, v in lab.items():
        if "\n" in v:
            print(f"error: label {k} has a newline", file=sys.stderr)
            return 2
    if args.format == "labels":
        text = "".join(f"{k}={v}\n" for k, v in lab.items())
    else:
        text = json.dumps({"labels": lab, "patches": patches}, indent=2) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
