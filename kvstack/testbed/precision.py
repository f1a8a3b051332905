"""What a numeric comparison can hold on this host: the CPU's instruction sets, and the logprob
tolerance per dtype.

Streaming-vs-native comparisons (tests/env/streaming, ci/gpu/check_streaming.py) judge greedy
tokens and top-k logprobs. How close two runs of the same model can be depends on the dtype the
model runs in, not on the code under test:

- bfloat16 keeps 8 significant bits (~2.4 decimal digits): a logit of magnitude 8-16 (a sharpened
  tiny model's, or a trained one's) is resolved to 0.0625, so a different reduction order
  (another batch shape, tensor parallelism's all-reduce, vLLM's AMX kernel on Intel CPUs) moves a
  logprob by about one such step: 0.08 is one step with a margin (measured: native TP 2 vs native
  TP 1 up to 0.09 on an AMD EPYC; AMX vs vec kernel up to 0.06 on a Sapphire Rapids);
- float16 keeps 11 bits (~3.3 digits): eight times finer, 0.0078 at 8-16; 0.02 is 2.5 steps;
- float32 keeps 24 bits: 0.002.

Every comparison that uses these also runs a negative control whose change is far larger
(ci/gpu/check_streaming.py: 0.8 nats), so the tolerance cannot hide a wrong history.

`LOGPROB_TOL` is the tolerance stated per dtype; comparisons look it up with `logprob_tol(dtype)`
instead of carrying one number for every machine. Greedy tokens stay exact except at a step whose
top-2 margin is itself within the tolerance (a tie at that precision: see
ci/gpu/check_streaming.py `compare`).

`cpu_features()` reads /proc/cpuinfo (no torch needed) so a CI log says which machine it ran on:
tests/conftest.py prints it in pytest's header and summary.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# nats, absolute, on any top-k logprob both runs report
LOGPROB_TOL = {"bfloat16": 0.08, "float16": 0.02, "float32": 0.002}


def logprob_tol(dtype: str | None) -> float:
    """The tolerance for runs in `dtype` ("bfloat16", "float16", "float32"; None or "auto": the
    tiny models' bfloat16)."""
    name = str(dtype or "bfloat16").replace("torch.", "")
    name = {"bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32",
            "fp32": "float32", "auto": "bfloat16"}.get(name, name)
    if name not in LOGPROB_TOL:
        raise ValueError(f"no logprob tolerance for dtype {dtype!r} (known: {sorted(LOGPROB_TOL)})")
    return LOGPROB_TOL[name]


def cpu_features(cpuinfo: str | None = None) -> dict:
    """{"model", "cores", "amx", "avx512", "avx512_bf16"} of this machine's CPU."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    model, flags = platform.processor() or platform.machine(), set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 0
    return {"model": model, "cores": cores, "amx": "amx_tile" in flags,
            "avx512": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags}


def describe_host() -> str:
    """One line for a CI log: the CPU, AMX or not, and the dtype of the CPU engine's exactness
    comparisons (float16 on AMX, where vLLM's bf16 AMX kernel is avoided; else bfloat16)."""
    f = cpu_features()
    isa = "AMX" if f["amx"] else ("AVX-512, no AMX" if f["avx512"] else "no AVX-512, no AMX")
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA")
    dtype = "float16" if f["amx"] else "bfloat16"
    return (f"{f['model']}, {f['cores']} cores, {isa}"
            + (f" (ONEDNN_MAX_CPU_ISA={onednn})" if onednn else "")
            + f"; CPU-engine exactness dtype {dtype} (logprob tolerance {logprob_tol(dtype)} nats)")
