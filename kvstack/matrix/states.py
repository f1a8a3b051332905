"""Cell states, their colours and marks, and the Cell record (shared by every other module)."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

S_APPLIES = "applies"
S_OFFSET = "applies with offset"
S_CONFLICTS = "conflicts"
S_UPSTREAM = "already upstream"
S_PASS = "pass"
S_FAIL = "fail"
S_SKIPPED = "skipped"  # tests were collected, none ran: never drawn as pass
S_NOT_RUN = "not run"
S_ERROR = "error"
S_NONE = "no patches"

STATES = (S_APPLIES, S_OFFSET, S_UPSTREAM, S_CONFLICTS, S_PASS, S_FAIL, S_SKIPPED, S_NOT_RUN, S_ERROR,
          S_NONE)
COLORS = {
    S_APPLIES: "#2e7d32",
    S_OFFSET: "#9ccc65",
    S_UPSTREAM: "#1e88e5",
    S_CONFLICTS: "#e53935",
    S_PASS: "#2e7d32",
    S_FAIL: "#e53935",
    S_SKIPPED: "#ffb300",
    S_NOT_RUN: "#d6d6d6",
    S_ERROR: "#8e24aa",
    S_NONE: "#f2f2f2",
}
SHORT = {
    S_APPLIES: "applies",
    S_OFFSET: "offset",
    S_UPSTREAM: "upstream",
    S_CONFLICTS: "CONFLICT",
    S_PASS: "pass",
    S_FAIL: "FAIL",
    S_SKIPPED: "skipped",
    S_NOT_RUN: "not run",
    S_ERROR: "ERROR",
    S_NONE: "-",
}
MD_MARK = {
    S_APPLIES: "✅",
    S_OFFSET: "☑️",
    S_UPSTREAM: "🔵",
    S_CONFLICTS: "❌",
    S_PASS: "✅",
    S_FAIL: "❌",
    S_SKIPPED: "🟡",
    S_NOT_RUN: "⚪",
    S_ERROR: "⚠️",
    S_NONE: "",
}
ANSI = {
    S_APPLIES: "32", S_OFFSET: "32", S_UPSTREAM: "34", S_CONFLICTS: "31;1", S_PASS: "32",
    S_FAIL: "31;1", S_SKIPPED: "33", S_NOT_RUN: "90", S_ERROR: "35;1", S_NONE: "90",
}
LABEL = {"vllm": "vLLM", "lmcache": "LMCache"}
SCHEMA = 2


def log(msg: str) -> None:
    print(f"[matrix] {msg}", file=sys.stderr, flush=True)


def version_key(version: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", version))


@dataclass
class Cell:
    state: str
    detail: str = ""
    how: str = ""  # for already upstream: "reverse-applies" / "probe"
    note: str = ""

    def text(self) -> str:
        bits = [self.state]
        if self.how:
            bits.append(f"({self.how})")
        out = " ".join(bits)
        if self.detail:
            out += f": {self.detail}"
        if self.note:
            out += f" [{self.note}]"
        return out
