"""Logits soft-cap, ALiBi and attention sinks in the windowed path (issue 13): windows of the
host-tier history merged by log-sum-exp equal one softmax over all keys with the feature, in
float64. Each case also checks that the feature changes the result (so a path that ignored it
would fail here)."""

import pytest
import torch

from kvstack.streaming.windowed import Features, windowed_attention

Hq, Hkv, D = 4, 2, 32


def reference(q, k, v, scale, ctx, features: Features):
    """Causal softmax attention of q (positions ctx..) over all of k/v with the features."""
    T, S = q.shape[0], k.shape[0]
    kk = k.double().repeat_interleave(Hq // Hkv, dim=1)
    vv = v.double().repeat_interleave(Hq // Hkv, dim=1)
    s = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    if features.softcap:
        s = features.softcap * torch.tanh(s / features.softcap)
    if features.alibi is not None:
        qp = torch.arange(ctx, ctx + T, dtype=torch.float64)
        kp = torch.arange(S, dtype=torch.float64)
        s = s + features.alibi.double().view(-1, 1, 1) * (kp[None, :] - qp[:, None])
    s = s.masked_fill(torch.arange(S)[None, :] > (torch.arange(T)[:, None] + ctx), float("-inf"))
    if features.sinks is not None:
        sink = features.sinks.double().view(-1, 1, 1).expand(Hq, T, 1)
        p = torch.cat([s, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        p = s.softmax(-1)
    return torch.einsum("hts,shd->thd", p, vv)


FEATURES = {
    "softcap": Features(softcap=2.0),
    "alibi": Features(alibi=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "sinks": Features(sinks=torch.tensor([1.5, -0.5, 3.0, 0.0])),
    "all": Features(softcap=3.0, alibi=torch.tensor([0.3, 0.2, 0.1, 0.05]),
                    sinks=torch.tensor([0.5, 2.0, -1.0, 1.0])),
}


@pytest.mark.parametrize("name", sorted(FEATURES))
@pytest.mark.parametrize("ctx,new,window", [(0, 6, 4), (70, 1, 16), (45, 9, 7)])
def test_windowed_with_feature_equals_full(name, ctx, new, window):
    torch.manual_seed(ctx + new)
    scale = 4 * D**-0.5  # sharper than uniform, so the soft-cap bites
    q, k, v = torch.randn(new, Hq, D), torch.randn(ctx + new, Hkv, D), torch.randn(ctx + new, Hkv, D)
    feat = FEATURES[name]

    def history(s, e):
        return k[s:e], v[s:e]

    out = windowed_attention(q, k[ctx:], v[ctx:], history, ctx, window, scale, features=feat)
    ref = reference(q, k, v, scale, ctx, feat)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    plain = reference(q, k, v, scale, ctx, Features())
    assert (plain - ref).abs().max() > 1e-3, f"{name} does not change this case: a weak test"
