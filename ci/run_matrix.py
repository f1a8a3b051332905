#!/usr/bin/env python3
"""Run kvstack's regression matrix (the patch stack x upstream releases x suites).

Needs only the system python3 (>= 3.11, for tomllib) for `--suites apply`: no vLLM, no venv.
Axes: ci/matrix.toml. Library and documentation: kvstack/matrix.py. `--help` for options.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstack.matrix import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
