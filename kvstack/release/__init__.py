"""Release tooling: what turns pinned upstream sources into a patched kvstack.

- `pins`: the pin files (versions, sdists, wheels, sha256) of each base.
- `fetch`: download (cached), verify and unpack the pinned sdists.
- `patchstack`: read a series, check it against a tree or site-packages, apply it all-or-nothing.
- `roundtrip`: the lossless import/export of a series to and from a git work tree.
- `overlay`: the series reversed in an overlay in front of site-packages ("upstream" in-process).
- `doctor`: which base an environment holds and every patch's state in it.

Nothing here imports vLLM; the scripts in scripts/ are thin entry points to these modules.
"""
