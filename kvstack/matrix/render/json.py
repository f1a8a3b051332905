"""matrix.json: the matrix document as committed (machine-local paths left out)."""

from __future__ import annotations

import json


def public_json(doc: dict) -> str:
    public = json.loads(json.dumps(doc))
    for rels in public["releases"].values():
        for r in rels:
            r.pop("tree", None)  # machine-local path; not for a committed file
    return json.dumps(public, indent=1, sort_keys=False) + "\n"
