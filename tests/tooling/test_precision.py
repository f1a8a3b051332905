"""kvstack.testbed.precision: the logprob tolerance per dtype and the host's CPU line."""

import pytest

from kvstack.testbed.precision import LOGPROB_TOL, cpu_features, describe_host, logprob_tol

EPYC = """processor\t: 0
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16
processor\t: 1
model name\t: AMD EPYC 9B14
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16
"""
SPR = "model name\t: Intel(R) Xeon(R) Platinum 8481C\nflags\t\t: avx512f amx_bf16 amx_tile amx_int8\n"


def test_tolerance_per_dtype_finer_with_more_mantissa_bits():
    assert LOGPROB_TOL["bfloat16"] > LOGPROB_TOL["float16"] > LOGPROB_TOL["float32"]
    assert logprob_tol("bfloat16") == logprob_tol("torch.bfloat16") == logprob_tol(None)
    assert logprob_tol("auto") == logprob_tol("bf16") == LOGPROB_TOL["bfloat16"]
    assert logprob_tol("half") == logprob_tol("fp16") == LOGPROB_TOL["float16"]
    with pytest.raises(ValueError, match="no logprob tolerance for dtype 'int8'"):
        logprob_tol("int8")


def test_cpu_features_read_amx_from_cpuinfo():
    epyc = cpu_features(EPYC)
    assert epyc["model"] == "AMD EPYC 9B14" and not epyc["amx"] and epyc["avx512"]
    spr = cpu_features(SPR)
    assert spr["amx"] and spr["avx512"] and spr["model"].startswith("Intel(R) Xeon")
    assert cpu_features("")["amx"] is False


def test_describe_host_names_isa_and_dtype():
    line = describe_host()
    assert "cores" in line and "exactness dtype" in line and "nats" in line
    assert (" cores, AMX" in line) == ("dtype float16" in line)
