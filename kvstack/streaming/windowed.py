"""Attention of one request's new tokens over its host-tier history, in windows.

For query tokens at positions ``[ctx, ctx + n)`` and a history of ``ctx`` tokens kept in the host
tier, the history is attended window by window (``window_tokens`` at a time, each window copied to
the query's device), and the new tokens' own K/V with the causal mask; the partial results are
combined by the log-sum-exp rule (``Partials``): on a GPU with vLLM's ``merge_attn_states`` as each
partial comes, on the CPU in groups. The result equals softmax attention over the concatenated K/V.
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
    """torch's fused attention kernels that also return the LSE (CPU: float32 in/out). On the
    CPU the causal kernel takes GQA as it is (query head h over KV head h // rep, checked equal to
    repeating K/V); on a GPU K/V are repeated per query head (torch's CUDA flash op is not relied
    on for GQA there)."""
    if not causal:
        out, lse = WindowQuery(q, scale).attend(k, v)
        return out.float(), lse.float()
    rep = q.shape[1] // k.shape[1]
    if q.device.type == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        q, k, v = q.float(), k.float(), v.float()
        rep = 1
    else:
        op = torch.ops.aten._scaled_dot_product_flash_attention
    qh = q.transpose(0, 1).unsqueeze(0)
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    res = op(qh, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), 0.0, causal,
             scale=scale)
    return res[0][0].transpose(0, 1).float(), res[1][0].float()


# Query rows (tokens x query heads per KV head) from which a bf16 model's windows are attended in
# bf16 only on a CPU with AMX: torch's CPU flash kernel runs bf16 on AMX tiles there; over a
# 1024-token window on one core of a Xeon with AMX 1.3x faster than float32 at 32 rows, 1.7-1.9x
# from 64 up, slower for a decode token (2 rows: 32 us against 20 us); without AMX 2x slower than
# float32.
BF16_MIN_ROWS = 32
_AMX: bool | None = None


def cpu_kernel_dtype(dtype: torch.dtype, rows: int) -> torch.dtype:
    """The dtype a window is attended in on the CPU: bf16 for a bf16 model's windows of at least
    BF16_MIN_ROWS query rows on a CPU with AMX (each partial rounded to bf16, as the model's own
    attention output is, and merged in float32), else float32. (A decode token's windows stay
    float32 even where bf16 would read half the bytes straight from the host pages: torch's bf16
    kernel moved the sharp model's logprobs 0.033-0.058 from native's in one window, beyond one
    bf16 ulp; float32 matches them.)"""
    global _AMX
    if dtype != torch.bfloat16 or rows < BF16_MIN_ROWS:
        return torch.float32
    if _AMX is None:
        try:
            _AMX = bool(torch.cpu._is_amx_tile_supported())
        except Exception:  # noqa: BLE001 - an older torch: no AMX path
            _AMX = False
    return torch.bfloat16 if _AMX else torch.float32


class WindowQuery:
    """A request's query prepared once for the windows of its history (plain scores, no mask: the
    fused kernel): GQA without copying K/V rep times, the rep query heads of a KV head becoming
    rep x more query rows of that head (row t*rep + r; without a mask rows are independent);
    float32 on the CPU. ``attend(k, v)`` with a window's K/V [S, Hkv, D] gives
    (out [T, Hq, Dv], lse [Hq, T]) without redoing the query's layout per window; calling it
    returns None instead of raising where the kernel refuses (the caller falls back).

    ``dtype``: what the kernel runs in (the CPU: `cpu_kernel_dtype`, float32 unless given; a GPU:
    the query's); K/V of another dtype are converted (the CPU's staging buffers already are)."""

    def __init__(self, q: torch.Tensor, scale: float, dtype: torch.dtype | None = None):
        self.q, self.scale = q, scale
        self.T, self.Hq = q.shape[0], q.shape[1]
        self.cpu = q.device.type == "cpu"
        self.dtype = dtype or (torch.float32 if self.cpu else q.dtype)
        self.op = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu if self.cpu
                   else torch.ops.aten._scaled_dot_product_flash_attention)
        self._qf: dict[int, torch.Tensor] = {}  # per KV head count

    def attend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, Hq, Hkv = self.T, self.Hq, k.shape[1]
        rep = Hq // Hkv
        qf = self._qf.get(Hkv)
        if qf is None:
            qf = self._qf[Hkv] = (self.q.to(self.dtype).reshape(T, Hkv, rep, -1).transpose(0, 1)
                                  .reshape(1, Hkv, T * rep, -1))
        if k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        res = self.op(qf, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), 0.0,
                      False, scale=self.scale)
        if T == 1:  # a decode token: rows (KV head, rep) are its query heads in order already
            return res[0][0].reshape(1, Hq, -1), res[1][0].reshape(Hq, 1)
        out = res[0][0].reshape(Hkv, T, rep, -1).transpose(0, 1).reshape(T, Hq, -1)
        lse = res[1][0].reshape(Hkv, T, rep).transpose(1, 2).reshape(Hq, T)
        return out, lse

    def __call__(self, k: torch.Tensor, v: torch.Tensor):
        try:
            return self.attend(k, v)
        except (RuntimeError, NotImplementedError):
            return None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal_offset: int | None = None, features: Features | None = None,
           q_pos: int = 0, k_pos: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention: q [T, Hq, D], k/v [S, Hkv, D] -> (out [T, Hq, Dv] fp32, lse [Hq, T]).

    With ``causal_offset`` c, query t sees keys s <= t + c (keys and queries share positions
    shifted by c); without it every key is visible. ``features`` (soft-cap, ALiBi) change the
    scores; ``q_pos`` / ``k_pos`` are the absolute positions of the first query / key (ALiBi)."""
    plain = features is None or features.plain_scores
    if plain and causal_offset == 0 and q.shape[0] == 1 and k.shape[0] == 1:
        return _self_only(q, k, v, scale)
    if plain and (causal_offset is None or (causal_offset == 0 and q.shape[0] == k.shape[0])):
        try:
            return _flash(q, k, v, scale, causal_offset is not None)
        except (RuntimeError, NotImplementedError):
            pass  # unsupported dtype/shape/device: the reference path below
    return attend_reference(q, k, v, scale, causal_offset, None if plain else features,
                            q_pos, k_pos)


def _self_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token over its own key alone (a decode step's new token): the softmax of one score is 1,
    so each query head's output is its KV head's value and its LSE the score (plain scores only).
    A few element-wise ops instead of a kernel call on a 1 x 1 problem."""
    Hq, Hkv = q.shape[1], k.shape[1]
    rep = Hq // Hkv
    lse = (q.float().reshape(Hkv, rep, -1) * k.float().reshape(Hkv, 1, -1)).sum(-1).mul_(scale)
    out = v.float().reshape(1, Hkv, 1, -1).expand(1, Hkv, rep, -1).reshape(1, Hq, -1)
    return out, lse.reshape(Hq, 1)


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
    on the query's device at once: either an object with ``windows(ctx, window, dtype)`` yielding
    ``(start, k, v)`` on the query's device, in ``dtype`` where one is given (the CPU's kernel
    dtype), and ``append(ctx, k, v)`` taking the new tokens' K/V (transfer.PagedHistory: the
    connector's path, page runs copied into staging buffers on a copy stream, the next window
    loading while this one is attended, the new K/V written back after the windows, a decode
    token's before them), or a callable ``history(start, end) -> (k, v)`` (host tensors, copied
    as they come; the caller keeps the new K/V)."""
    T, dtype = q.shape[0], q.dtype
    plain = features is None or features.plain_scores
    span = ctx  # the history the windows cover
    appends = hasattr(history, "append")
    if appends and T == 1 and plain and ctx > 0:
        # a decode token (plain scores) sees every key, its own too: its K/V go to the history
        # first and are read back with the last window (no partial of its own, and with one
        # window no merge at all)
        history.append(ctx, new_k, new_v)
        span, appends = ctx + 1, False
    kernel = None  # the windows' kernel dtype (None: the query's)
    if q.device.type == "cpu" and ctx > 0:
        kernel = cpu_kernel_dtype(dtype, T * q.shape[1] // new_k.shape[1]) if plain \
            else torch.float32
    wq = WindowQuery(q, scale, kernel) if plain else None
    if kernel is not None:
        q = q.float()  # the new tokens' partial and the reference path run in float32
    parts = Partials(q.device)
    if span == ctx:
        parts.add(*attend(q, new_k, new_v, scale, 0, features, ctx, ctx))
    if hasattr(history, "windows"):
        windows = history.windows(span, window, kernel)
    else:  # host tensors, copied to the query's device as they come
        windows = ((s, *(t.to(q.device) for t in history(s, min(s + window, ctx))))
                   for s in range(0, ctx, window))
    for start, hk, hv in windows:
        part = wq(hk, hv) if wq is not None else None
        parts.add(*(part or attend(q, hk, hv, scale, None, features, ctx, start)))
    if appends:  # after the windows (a GPU's first window load need not wait for the new K/V)
        history.append(ctx, new_k, new_v)
    if features is not None and features.sinks is not None:
        # the sink: one more logit per head in the denominator, contributing no value
        sink_lse = features.sinks.to(device=q.device, dtype=torch.float32).view(-1, 1)
        parts.add(None, sink_lse.expand(-1, T))
    acc = parts.result()
    if out is None:
        return acc.to(dtype)
    out[:T].copy_(acc)
    return out


# Partial results the CPU keeps before merging them in one pass (a group); a decode token's are a
# few KiB, a 2048-token chunk's of a small model 1 MiB.
CPU_GROUP_BYTES = 16 << 20
# Elements of a partial up to which a group is merged by one weighted sum over the stacked
# partials (fewer op calls), beyond it by one multiply-add per partial (no stacked copy).
SMALL_PARTIAL = 8192


class Partials:
    """The LSE merge of one request's partial results (out [T, H, Dv] float32, lse [H, T]).

    - ``grouped=False`` (a GPU): each partial is merged into the running accumulator as it comes,
      with vLLM's ``merge_attn_states`` (one fused kernel; no device memory beyond the two
      accumulators the device scratch plan counts).
    - ``grouped=True`` (the CPU, the default there): partials are kept and merged in groups of up
      to ``group_bytes``, the running result being one of them: one weighted sum per group
      instead of a pairwise merge per window (for a decode token a dozen op calls per window less;
      for a prefill chunk three passes over the accumulator per window less).

    A partial's ``out`` may be None (a sink: no value, its LSE only). An LSE of +inf (what
    FlashAttention writes for an empty key range) counts as -inf: no keys."""

    def __init__(self, device: torch.device, grouped: bool | None = None,
                 group_bytes: int = CPU_GROUP_BYTES):
        self.grouped = device.type == "cpu" if grouped is None else grouped
        self.group_bytes = group_bytes
        self._outs: list[torch.Tensor | None] = []
        self._lses: list[torch.Tensor] = []
        self._max = 0  # partials per group, from the first partial's size

    def add(self, out: torch.Tensor | None, lse: torch.Tensor) -> None:
        if not self._lses:
            assert out is not None, "the first partial has a value"
            self._outs.append(out.float())
            self._lses.append(lse.float())
            self._max = max(2, self.group_bytes // max(1, out.numel() * 4))
            return
        if not self.grouped:
            acc, acc_lse = self._outs[0], self._lses[0]
            part = torch.zeros_like(acc) if out is None else out.float()
            merged, merged_lse = torch.empty_like(acc), torch.empty_like(acc_lse)
            merge(merged, part, lse.contiguous(), acc, acc_lse, merged_lse)
            self._outs[0], self._lses[0] = merged, merged_lse
            return
        self._outs.append(None if out is None else out.float())
        self._lses.append(lse)
        if len(self._lses) > self._max:
            self._fold()

    def _fold(self) -> None:
        if len(self._lses) == 1:
            return
        lse = torch.stack(self._lses).float()  # [G, H, T]
        lse = lse.masked_fill(lse == float("inf"), NEG_INF)
        tot = torch.logsumexp(lse, 0)  # [H, T]
        w = torch.exp(lse - torch.where(torch.isinf(tot), torch.zeros_like(tot), tot))
        wt = w.transpose(1, 2).unsqueeze(-1)  # [G, T, H, 1]
        kept = [i for i, o in enumerate(self._outs) if o is not None]  # sinks carry no value
        if self._outs[0].numel() <= SMALL_PARTIAL:  # a few decode tokens: fewest op calls
            outs = torch.stack([self._outs[i] for i in kept])  # [G, T, H, Dv], float32
            acc = (outs * (wt if len(kept) == len(self._outs) else wt[kept])).sum(0)
        else:  # one pass over each partial, none over a stacked copy
            acc = self._outs[0] * wt[0]
            for i in kept[1:]:
                acc.addcmul_(self._outs[i], wt[i])
        self._outs, self._lses = [acc], [tot]

    def result(self) -> torch.Tensor:
        """The merged output, float32 [T, H, Dv]."""
        self._fold()
        return self._outs[0]
