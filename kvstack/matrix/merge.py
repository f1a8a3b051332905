"""`python -m kvstack.matrix.merge OUT IN...`: the test suites of junit files IN (missing ones
skipped) in one file OUT, as `make test` writes build/junit/tests-<base>.xml from its parallel and
serial passes (kvstack.matrix.results.merge_junit)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvstack.matrix.results import merge_junit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvstack.matrix.merge", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("inputs", type=Path, nargs="+")
    args = ap.parse_args(argv)
    n = merge_junit(args.out, args.inputs)
    print(f"{args.out}: {n} test cases from {', '.join(str(p) for p in args.inputs if p.is_file())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
