"""The `kvstack` command: one entry point for the distribution's tools."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "doctor": ("check pinned versions and every patch's state in this environment", "kvstack.release.doctor"),
        "fetch": ("download, verify and unpack the pinned sdists", "kvstack.release.fetch"),
        "apply": ("apply the patch stack (see scripts/apply_patches.sh --help)", "kvstack.release.patchstack"),
        "upstream-status": ("propose each patch's Upstream-Status / Drop-When from the regression matrix",
                            "kvstack.matrix.upstream_status"),
        "tiny-models": ("make the tiny random-weight test models locally", "kvstack.testbed.tiny_models"),
        "demo": ("run a short generation through the patched CPU engine", "kvstack.testbed.demo"),
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        parser = argparse.ArgumentParser(prog="kvstack", description="kvstack: vLLM + LMCache with a patch stack.")
        parser.add_argument("command", choices=sorted(commands),
                            help="; ".join(f"{k}: {v[0]}" for k, v in commands.items()))
        if argv and argv[0] not in ("-h", "--help"):
            parser.parse_args(argv[:1])  # exits with a usage error naming the choices
        parser.print_help()
        return 0 if argv else 2
    import importlib

    module = importlib.import_module(commands[argv[0]][1])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
