"""Attention of one request's new tokens over its host-tier history, in windows.

For query tokens at positions ``[ctx, ctx + n)`` and a history of ``ctx`` tokens kept in the host
tier, the history is attended window by window (``window_tokens`` at a time, each window copied to
the query's device), and the new tokens' own K/V with the causal mask; the partial results are
combined by the log-sum-exp rule with vLLM's ``merge_attn_states`` (its torch fallback on CPU).
The result equals softmax attention over the concatenated K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True, eq=False)
class Features:
    """What a layer's backend adds to plain softmax attention (read from its impl at start-up).

    - ``softcap``: logits soft-cap (Gemma-2): scaled scores s become ``softcap * tanh(s / softcap)``.
    - ``alibi``: ALiBi slopes [Hq]: ``slope * (key_pos - query_pos)`` added after the soft-cap.
    - ``sinks``: attention-sink logits [Hq] (gpt-oss): one extra logit per head in the softmax
      denominator with no value, i.e. one more partial result (output 0, LSE = sink) to merge.
    Positions are absolute, so windows of the history and the new tokens agree."""

    softcap: float = 0.0
    alibi: torch.Tensor | None = None
    sinks: torch.Tensor | None = None

    @property
    def plain_scores(self) -> bool:
        return not self.softcap and self.alibi is None

    @property
    def plain(self) -> bool:
        return self.plain_scores and self.sinks is None


def _merge_fn() -> Callable:
    try:
        from vllm.v1.attention.ops.merge_attn_states import merge_attn_states
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # Make sure the torch fallback is there (kvstack's merge patch); else use ours.
            import vllm.v1.attention.ops.torch_merge_attn_states  # noqa: F401
        return merge_attn_states
    except Exception:  # noqa: BLE001 - no vLLM / no fallback: same rule in torch
        return torch_merge


def torch_merge(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                output_lse=None, prefill_tokens_with_context=None, output_scale=None):
    """Same contract as vLLM's merge_attn_states (outputs [T, H, D], LSEs [H, T])."""
    p_lse = prefix_lse.float().masked_fill(prefix_lse == float("inf"), NEG_INF)
    s_lse = suffix_lse.float().masked_fill(suffix_lse == float("inf"), NEG_INF)
    m = torch.maximum(p_lse, s_lse)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    pw, sw = torch.exp(p_lse - m_safe), torch.exp(s_lse - m_safe)
    tot = pw + sw
    out = (prefix_output.float() * (pw / tot).T.unsqueeze(-1)
           + suffix_output.float() * (sw / tot).T.unsqueeze(-1))
    output.copy_(out.to(output.dtype))
    if output_lse is not None:
        output_lse.copy_(torch.log(tot) + m_safe)


_MERGE: Callable | None = None


def merge(*args) -> None:
    global _MERGE
    if _MERGE is None:
        _MERGE = _merge_fn()
    _MERGE(*args)


def _flash(q, k, v, scale, causal):
    """torch's fused attention kernels that also return the LSE (CPU: float32 in/out)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    rep = Hq // Hkv
    if q.device.type == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        q, k, v = q.float(), k.float(), v.float()
    else:
        op = torch.ops.aten._scaled_dot_product_flash_attention
    if rep > 1 and not causal:
        # GQA without copying K/V rep times: the rep query heads of a KV head become rep x more
        # query rows of that head (row t*rep + r); without a mask, rows are independent.
        qf = q.reshape(T, Hkv, rep, D).transpose(0, 1).reshape(1, Hkv, T * rep, D)
        res = op(qf, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), 0.0, False,
                 scale=scale)
        out = res[0][0].reshape(Hkv, T, rep, -1).transpose(0, 1).reshape(T, Hq, -1)
        lse = res[1][0].reshape(Hkv, T, rep).transpose(1, 2).reshape(Hq, T)
        return out.float(), lse.float()
    qh = q.transpose(0, 1).unsqueeze(0)
    kh = k.repeat_interleave(rep, 1).transpose(0, 1).unsqueeze(0)
    vh = v.repeat_interleave(rep, 1).transpose(0, 1).unsqueeze(0)
    res = op(qh, kh, vh, 0.0, causal, scale=scale)
    return res[0][0].transpose(0, 1).float(), res[1][0].float()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal_offset: int | None = None, features: Features | None = None,
           q_pos: int = 0, k_pos: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention: q [T, Hq, D], k/v [S, Hkv, D] -> (out [T, Hq, Dv] fp32, lse [Hq, T]).

    With ``causal_offset`` c, query t sees keys s <= t + c (keys and queries share positions
    shifted by c); without it every key is visible. ``features`` (soft-cap, ALiBi) change the
    scores; ``q_pos`` / ``k_pos`` are the absolute positions of the first query / key (ALiBi)."""
    plain = features is None or features.plain_scores
    if plain and (causal_offset is None or (causal_offset == 0 and q.shape[0] == k.shape[0])):
        try:
            return _flash(q, k, v, scale, causal_offset is not None)
        except (RuntimeError, NotImplementedError):
            pass  # unsupported dtype/shape/device: the reference path below
    return attend_reference(q, k, v, scale, causal_offset, None if plain else features,
                            q_pos, k_pos)


def attend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     causal_offset: int | None = None, features: Features | None = None,
                     q_pos: int = 0, k_pos: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` in plain torch ops (float32)."""
    T, Hq, _ = q.shape
    S, Hkv, _ = k.shape
    rep = Hq // Hkv
    qf = q.float().view(T, Hkv, rep, -1)
    scores = torch.einsum("tgrd,sgd->grts", qf, k.float()) * scale  # [Hkv, rep, T, S]
    if features is not None and features.softcap:
        scores = features.softcap * torch.tanh(scores / features.softcap)
    if features is not None and features.alibi is not None:
        slopes = features.alibi.to(device=q.device, dtype=torch.float32).view(Hkv, rep, 1, 1)
        qp = torch.arange(q_pos, q_pos + T, device=q.device, dtype=torch.float32)
        kp = torch.arange(k_pos, k_pos + S, device=q.device, dtype=torch.float32)
        scores = scores + slopes * (kp.unsqueeze(0) - qp.unsqueeze(1))
    if causal_offset is not None:
        t = torch.arange(T, device=q.device).unsqueeze(1)
        s = torch.arange(S, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(s > t + causal_offset, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, rep, T]
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - lse_safe.unsqueeze(-1))
    out = torch.einsum("grts,sgd->tgrd", probs, v.float()).reshape(T, Hq, -1)
    return out, lse.reshape(Hq, T)


def windowed_attention(q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                       history, ctx: int, window: int, scale: float,
                       out: torch.Tensor | None = None,
                       features: Features | None = None) -> torch.Tensor:
    """Causal attention of q (positions ctx..ctx+T-1) over history [0, ctx) + new K/V.

    ``history`` gives the history's K/V one window at a time, so only a window or two of it are
    on the query's device at once: either an object with ``windows(ctx, window)`` yielding
    ``(start, k, v)`` on the query's device (transfer.PagedHistory: the connector's path, page runs
    copied into staging buffers on a copy stream, the next window loading while this one is
    attended), or a callable ``history(start, end) -> (k, v)`` (host tensors, copied as they come)."""
    T, dtype = q.shape[0], q.dtype
    if q.device.type == "cpu" and ctx > 0:
        q = q.float()  # once, not per window (the CPU kernels run in float32)
    acc, acc_lse = attend(q, new_k, new_v, scale, 0, features, ctx, ctx)
    if hasattr(history, "windows"):
        windows = history.windows(ctx, window)
    else:
        windows = ((s, *history(s, min(s + window, ctx))) for s in range(0, ctx, window))
    for start, hk, hv in windows:
        part, part_lse = attend(q, hk.to(q.device), hv.to(q.device), scale, None, features,
                                ctx, start)
        acc, acc_lse = _merged(part, part_lse, acc, acc_lse)
    if features is not None and features.sinks is not None:
        # the sink: one more logit per head in the denominator, contributing no value
        sink_lse = features.sinks.to(device=q.device, dtype=torch.float32).view(-1, 1)
        acc, acc_lse = _merged(torch.zeros_like(acc), sink_lse.expand_as(acc_lse).contiguous(),
                               acc, acc_lse)
    if out is None:
        return acc.to(dtype)
    out[:T].copy_(acc.to(out.dtype))
    return out


def _merged(part, part_lse, acc, acc_lse):
    merged = torch.empty_like(acc)
    merged_lse = torch.empty_like(acc_lse)
    merge(merged, part, part_lse, acc, acc_lse, merged_lse)
    return merged, merged_lse
