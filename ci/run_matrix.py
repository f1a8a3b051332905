#!/usr/bin/env python3
"""Run kvstack's regression matrix (the patch stack x upstream releases x suites).

Needs only the system python3 (>= 3.11, for tomllib) for `--suites apply`: no vLLM, no venv.
Axes: ci/matrix.toml and the bases' pins (vllm/<base>.env, lmcache/<base>.env). Library and
documentation: the kvstack/matrix/ package (its __init__ says which module holds what). `--help` for options; `--propose-base` for a pin bump.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstack.matrix.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
