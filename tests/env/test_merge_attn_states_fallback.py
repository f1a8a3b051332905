"""The torch fallback of vLLM's merge_attn_states (kvstack patch, issue 4), in the CPU venv.

vLLM 0.25.1 merges partial attention states (output + log-sum-exp) with a CUDA or a Triton
kernel only; kvstack's patch adds `vllm/v1/attention/ops/torch_merge_attn_states.py` and a
dispatcher branch to it on CPU (or without Triton). The streaming attention connector relies
on it to merge the per-window partial attentions over the host tier.

Checked here against a float64 reference attention that also returns the LSE:
merging the partials over two parts of a KV sequence equals attention over the whole
sequence (random shapes, causal and not, fp32 and bf16), with these tolerances:
  fp32 output: atol = rtol = 1e-5;  bf16 output: atol = rtol = 2e-2;  LSE (fp32): 1e-5.
Also: prefill_tokens_with_context copies the suffix rows, output_lse, -inf/+inf LSE rows,
FP8 output via output_scale, strided/aliased outputs, and that the public
`vllm.v1.attention.ops.merge_attn_states.merge_attn_states` dispatches to the torch path on CPU.

This test applies nothing: it expects the kvstack vLLM series to be applied to the venv
(CI always does) and fails with instructions when it is not. On base 0.32 (vLLM 0.32.0) the torch
path is upstream (vllm#51471, in 0.29.0: `_merge_attn_states_torch` in the public module) and the
patch is not in that base's series: the same contract is checked on upstream's implementation.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

pytestmark = pytest.mark.env

PUBLIC = "vllm.v1.attention.ops.merge_attn_states"
FALLBACK = "vllm.v1.attention.ops.torch_merge_attn_states"
APPLY_HINT = (
    "scripts/apply_patches.sh --site-packages .venv/lib/python3.11/site-packages --component vllm"
)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
LSE_TOL = 1e-5
INF = float("inf")


def _series_carries_the_fallback() -> bool:
    from kvstack.release.overlay import series_patches
    from kvstack.release.pins import load_pin

    return any("merge_attn_states-torch-fallback" in p.name for p in series_patches(load_pin("vllm").series_dir))


@pytest.fixture(scope="module")
def fallback():
    """(module, name) of the torch merge the public entry point dispatches to on CPU."""
    try:
        import vllm
    except ImportError as exc:
        pytest.fail(f"vLLM is not importable with {sys.executable} ({exc}); run this test in the "
                    "kvstack venv (.venv, built by scripts/build_env.sh)", pytrace=False)
    if not _series_carries_the_fallback():  # base 0.32: upstream's own torch path
        return importlib.import_module(PUBLIC), "_merge_attn_states_torch"
    try:
        return importlib.import_module(FALLBACK), "merge_attn_states"
    except ModuleNotFoundError as exc:
        if exc.name != FALLBACK:
            raise
    pytest.fail(f"{FALLBACK} does not exist in {vllm.__path__[0]}: the kvstack vLLM patch "
                "series (merge_attn_states torch fallback) is not applied to this environment. "
                f"Apply it with: {APPLY_HINT}", pytrace=False)


@pytest.fixture(scope="module")
def merge(fallback):
    """The public entry point, as the connector and vLLM's backends call it."""
    return importlib.import_module(PUBLIC).merge_attn_states


def ref_attention(q, k, v, q_pos, k_pos, causal):
    """Softmax attention in float64. q [T,H,D], k/v [S,H,D] -> out [T,H,D], lse [H,T].

    A row with no visible key has lse = -inf and a zero output (attention over nothing).
    """
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) * q.shape[-1] ** -0.5
    if causal:
        visible = k_pos[None, :] <= q_pos[:, None]  # [T, S]
        scores = scores.masked_fill(~visible, -INF)
    lse = torch.logsumexp(scores, dim=-1)  # [H, T]
    probs = torch.where(torch.isinf(lse)[..., None], 0.0, torch.exp(scores - lse[..., None]))
    out = torch.einsum("hts,shd->thd", probs, v.double())
    return out, lse


def split_case(gen, dtype, causal, *, split=None, scale=1.0, min_t=1):
    """Random shapes; queries are the last T positions of an S-token sequence cut at `split`
    (random if None, "late" = inside the query rows, so that early causal rows see no suffix key)."""
    t = int(torch.randint(min_t, 40, (1,), generator=gen))
    s = t + int(torch.randint(0, 60, (1,), generator=gen))
    h = int(torch.randint(1, 6, (1,), generator=gen))
    d = [8, 20, 32, 36, 64, 80, 128][int(torch.randint(0, 7, (1,), generator=gen))]
    if split is None:
        split = int(torch.randint(1, s, (1,), generator=gen)) if s > 1 else 0
    elif split == "late":
        split = s - (t + 1) // 2
    q = (torch.randn(t, h, d, generator=gen) * scale).to(dtype)
    k = torch.randn(s, h, d, generator=gen).to(dtype)
    v = torch.randn(s, h, d, generator=gen).to(dtype)
    q_pos, k_pos = torch.arange(s - t, s), torch.arange(s)
    p_out, p_lse = ref_attention(q, k[:split], v[:split], q_pos, k_pos[:split], causal)
    s_out, s_lse = ref_attention(q, k[split:], v[split:], q_pos, k_pos[split:], causal)
    full_out, full_lse = ref_attention(q, k, v, q_pos, k_pos, causal)
    # What an attention backend hands over: outputs in the model dtype, LSE in float32.
    return dict(prefix_output=p_out.to(dtype), prefix_lse=p_lse.float(),
                suffix_output=s_out.to(dtype), suffix_lse=s_lse.float(),
                full_out=full_out.float(), full_lse=full_lse.float(), t=t, h=h, d=d)


def run_merge(merge, c, dtype, **kw):
    output = torch.full((c["t"], c["h"], c["d"]), 7.0, dtype=dtype)  # poison: all rows must be written
    output_lse = torch.full((c["h"], c["t"]), 7.0)
    merge(output, c["prefix_output"], c["prefix_lse"], c["suffix_output"], c["suffix_lse"],
          output_lse, **kw)
    return output, output_lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("seed", range(4))
def test_merge_of_two_parts_equals_attention_over_concatenated_kv(merge, seed, causal, dtype):
    gen = torch.Generator().manual_seed(1000 * seed + 10 * causal + (dtype == torch.bfloat16))
    c = split_case(gen, dtype, causal)
    out, lse = run_merge(merge, c, dtype)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), c["full_out"], atol=tol, rtol=tol)
    torch.testing.assert_close(lse, c["full_lse"], atol=LSE_TOL, rtol=LSE_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_large_logits_do_not_overflow(merge, dtype):
    # Scores in the hundreds: exp() of an LSE would overflow without the max subtraction.
    c = split_case(torch.Generator().manual_seed(7), dtype, causal=True, scale=60.0)
    assert c["full_lse"].abs().max() > 100
    out, lse = run_merge(merge, c, dtype)
    assert torch.isfinite(out.float()).all()
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), c["full_out"], atol=tol, rtol=tol)
    torch.testing.assert_close(lse, c["full_lse"], atol=1e-4, rtol=LSE_TOL)


@pytest.mark.parametrize("empty_lse", [-INF, INF], ids=["fa3_minus_inf", "fa2_plus_inf"])
def test_empty_prefix_rows_take_the_suffix(merge, empty_lse):
    c = split_case(torch.Generator().manual_seed(3), torch.float32, causal=False, split=0)
    assert torch.isinf(c["prefix_lse"]).all()  # attention over no keys
    c["prefix_lse"] = torch.full_like(c["prefix_lse"], empty_lse)
    out, lse = run_merge(merge, c, torch.float32)
    torch.testing.assert_close(out, c["suffix_output"], atol=0, rtol=0)
    torch.testing.assert_close(lse, c["suffix_lse"], atol=0, rtol=0)
    torch.testing.assert_close(out, c["full_out"], atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_causal_rows_with_empty_suffix_take_the_prefix_and_both_empty_gives_zero(merge):
    # Cut inside the query rows: the early causal rows see no suffix key (suffix lse -inf).
    c = split_case(torch.Generator().manual_seed(11), torch.float32, causal=True, split="late",
                   min_t=2)
    empty = torch.isinf(c["suffix_lse"])
    assert empty.any() and not torch.isinf(c["prefix_lse"]).any()
    out, lse = run_merge(merge, c, torch.float32)
    rows = empty.all(dim=0)
    torch.testing.assert_close(out[rows], c["prefix_output"][rows], atol=0, rtol=0)
    torch.testing.assert_close(lse[:, rows], c["prefix_lse"][:, rows], atol=0, rtol=0)
    torch.testing.assert_close(out, c["full_out"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, c["full_lse"], atol=LSE_TOL, rtol=LSE_TOL)

    # Both sides empty (possible with chunked prefill): zero output, -inf LSE, never NaN.
    t, h, d = 4, 2, 16
    po, so = torch.randn(t, h, d), torch.randn(t, h, d)
    pl, sl = torch.randn(h, t), torch.randn(h, t)
    pl[0, 1], sl[0, 1] = -INF, -INF
    pl[1, 2], sl[1, 2] = INF, -INF  # FA2's +inf counts as empty too
    po[1, 0] = so[2, 1] = float("nan")  # whatever an empty partial holds is not used
    output, output_lse = torch.empty(t, h, d), torch.empty(h, t)
    merge(output, po, pl, so, sl, output_lse)
    assert not output.isnan().any() and not output_lse.isnan().any()
    assert output[1, 0].eq(0).all() and output[2, 1].eq(0).all()
    assert output_lse[0, 1] == -INF and output_lse[1, 2] == -INF


# Two behaviours of kvstack's fallback (base 0.25) that upstream's torch path (base 0.32) does not
# have: it leaves output_lse of the rows past prefill_tokens_with_context unwritten, and it refuses
# FP8 output on CPU ("CPU fallback does not support FP8 output"). The streaming connector needs
# neither; on base 0.32 these two tests have no kvstack code to check.
kvstack_fallback_only = pytest.mark.skipif(
    "not _series_carries_the_fallback()",
    reason="upstream's torch merge (vLLM >= 0.29, base 0.32) leaves the LSE of rows >= n unwritten and "
           "refuses FP8 output on CPU; kvstack's fallback, which does both, is on base 0.25 only")


@kvstack_fallback_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_tokens_with_context_copies_suffix_rows(merge, dtype):
    c = split_case(torch.Generator().manual_seed(5), dtype, causal=False)
    t = c["t"]
    c["suffix_lse"][0, -1] = INF  # copied rows keep their LSE as it is, +inf included
    full_out, full_lse = run_merge(merge, c, dtype)
    for n in sorted({0, t // 2, t - 1, t, t + 3}):
        out, lse = run_merge(merge, c, dtype, prefill_tokens_with_context=n)
        m = min(n, t)
        assert torch.equal(out[m:], c["suffix_output"][m:]), f"n={n}: rows >= n must be suffix rows"
        assert torch.equal(lse[:, m:], c["suffix_lse"][:, m:]), f"n={n}: LSE of rows >= n"
        torch.testing.assert_close(out[:m], full_out[:m], atol=1e-6, rtol=1e-6,
                                   msg=lambda e: f"n={n}: rows < n must be merged: {e}")
        torch.testing.assert_close(lse[:, :m], full_lse[:, :m], atol=1e-6, rtol=1e-6)


def test_output_lse_is_optional(merge):
    c = split_case(torch.Generator().manual_seed(9), torch.float32, causal=True)
    with_lse, _ = run_merge(merge, c, torch.float32)
    output = torch.empty_like(with_lse)
    merge(output, c["prefix_output"], c["prefix_lse"], c["suffix_output"], c["suffix_lse"], None)
    assert torch.equal(output, with_lse)


@kvstack_fallback_only
def test_fp8_output_with_output_scale(merge):
    fp8 = torch.float8_e4m3fn
    c = split_case(torch.Generator().manual_seed(13), torch.bfloat16, causal=False)
    ref, _ = run_merge(merge, {**c}, torch.float32)  # same merge, unquantized float32 output
    scale = torch.tensor([0.004])  # some values land beyond the FP8 range (448) and clamp
    output = torch.empty(ref.shape, dtype=fp8)
    n = c["t"] // 2
    merge(output, c["prefix_output"], c["prefix_lse"], c["suffix_output"], c["suffix_lse"], None,
          prefill_tokens_with_context=n, output_scale=scale)
    # The kernels multiply by the reciprocal of the scale, then clamp and cast.
    expected = torch.cat([ref[:n], c["suffix_output"][n:].float()]) * (1.0 / scale)
    assert expected.abs().max() > torch.finfo(fp8).max
    expected = expected.clamp(torch.finfo(fp8).min, torch.finfo(fp8).max).to(fp8)
    torch.testing.assert_close(output.float(), expected.float(), atol=0, rtol=0)


def test_strided_and_in_place_output(merge):
    c = split_case(torch.Generator().manual_seed(17), torch.float32, causal=True)
    expected, _ = run_merge(merge, c, torch.float32)
    t, h, d = c["t"], c["h"], c["d"]
    padded = torch.zeros(t, h, d + 8)  # backends may pad the head stride of the output
    merge(padded[..., :d], c["prefix_output"], c["prefix_lse"], c["suffix_output"], c["suffix_lse"])
    assert torch.equal(padded[..., :d], expected) and padded[..., d:].eq(0).all()
    in_place = c["prefix_output"].clone()
    merge(in_place, in_place, c["prefix_lse"], c["suffix_output"], c["suffix_lse"])
    assert torch.equal(in_place, expected)


def test_public_merge_attn_states_dispatches_to_torch_on_cpu(fallback, merge, monkeypatch):
    from vllm.platforms import current_platform

    assert current_platform.is_cpu(), f"expected the CPU platform, got {current_platform.device_type}"
    calls = []
    module, name = fallback
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    c = split_case(torch.Generator().manual_seed(19), torch.bfloat16, causal=True)
    out, lse = run_merge(merge, c, torch.bfloat16, prefill_tokens_with_context=c["t"] - 1)
    assert len(calls) == 1, "the public merge_attn_states did not call the torch fallback on CPU"
    assert calls[0][0] is not None and calls[0][6] == c["t"] - 1  # arguments passed through
    assert torch.equal(out[-1], c["suffix_output"][-1])
