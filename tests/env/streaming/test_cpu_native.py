"""The CPU path (kvstack/streaming/cpu_native.py): the host tier in vLLM's CPU cache layout,
attended in place by vLLM's own CPU kernel through the layer's backend, all requests of a batch in
one call, their host pages as block table.

Pinned here: on random data and the real layer of a running engine, a batch of requests with
scattered pages equals softmax attention over [history; new] per request, and the new tokens land
in their pages; off the CPU backend (or with a page the kernel cannot take as a block) the path is
not used; an engine on this path produces the greedy tokens of native vLLM."""

import pytest
import torch

from streaming_helpers import close, make_llm, needs_hooks, prompt, tokens

pytestmark = needs_hooks

NOPE = "model.layers.3.self_attn.attn"  # the tiny Llama-4's streaming (NoPE) layer
PROMPTS = [700, 45, 300]
SHAPE = dict(max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=4)


@pytest.fixture(scope="module")
def reference():
    llm = make_llm("llama4", **SHAPE)
    try:
        return tokens(llm, [prompt(n, i) for i, n in enumerate(PROMPTS)])
    finally:
        close(llm)


@pytest.fixture(scope="module")
def streaming(reference):
    llm = make_llm("llama4", streaming=dict(window_tokens=1024, prefix_reuse=False), **SHAPE)
    yield llm
    close(llm)


def _layer(llm):
    from vllm.config import get_layers_from_vllm_config  # noqa: F401 (vLLM is importable)

    core = llm.llm_engine.engine_core.engine_core
    ctx = core.vllm_config.compilation_config.static_forward_context
    return ctx[NOPE]


def test_batch_in_place_equals_softmax_over_history_and_new(streaming):
    from kvstack.streaming import cpu_native
    from kvstack.streaming.host_tier import HostStore
    from kvstack.streaming.layout import ReqStep
    from kvstack.streaming.windowed import attend_reference

    layer = _layer(streaming)
    assert cpu_native.fits(layer, 32)
    torch.manual_seed(0)
    hq, hkv, d, P = 4, 2, 32, 32
    store = HostStore([NOPE], 16, P, hkv, d, torch.bfloat16, layout="cpu_kernel")
    # (history, new tokens, pages): scattered and out-of-order pages, a page shared by no one
    cases = [(0, 37, [5, 2]), (50, 37, [9, 0, 14, 3]), (64, 1, [7, 11, 1]),
             (200, 5, [15, 13, 12, 10, 8, 6, 4])]
    kv = {}
    for ctx, new, pages in cases:  # the history: written as earlier steps would have
        kv[ctx] = tuple(torch.randn(ctx + new, hkv, d).bfloat16() for _ in "kv")
        if ctx:
            hist = ReqStep("h", 0, ctx, 0, pages, pages=pages)
            b = cpu_native.kernel_batch([(0, ctx, hist)], P)
            layer.impl.do_kv_cache_update(layer, kv[ctx][0][:ctx], kv[ctx][1][:ctx],
                                          store.kv[NOPE], b.slot_mapping)
    segments, rows, qs, ks, vs = [], 0, [], [], []
    for i, (ctx, new, pages) in enumerate(cases):
        segments.append((rows, rows + new, ReqStep(f"r{i}", ctx, new, 0, pages, pages=pages)))
        rows += new
        qs.append(torch.randn(new, hq, d).bfloat16())
        ks.append(kv[ctx][0][ctx:])
        vs.append(kv[ctx][1][ctx:])
    batch = cpu_native.kernel_batch(segments, P)
    out = torch.full((rows + 3, hq, d), float("nan"), dtype=torch.bfloat16)  # 3 padding rows
    cpu_native.attend_in_place(layer, torch.cat(qs + [qs[0][:3]]), torch.cat(ks + [ks[0][:3]]),
                               torch.cat(vs + [vs[0][:3]]), out, store.kv[NOPE], batch)
    for (a, b, r), q in zip(segments, qs):
        k, v = kv[r.start]
        ref, _ = attend_reference(q, k, v, float(layer.impl.scale), causal_offset=r.start)
        torch.testing.assert_close(out[a:b].float(), ref, atol=2e-2, rtol=2e-2)
    # negative control: a wrong page in one block table row changes that request's output
    batch.block_table[1, 0] = 15
    again = torch.zeros_like(out)
    cpu_native.attend_in_place(layer, torch.cat(qs + [qs[0][:3]]), torch.cat(ks + [ks[0][:3]]),
                               torch.cat(vs + [vs[0][:3]]), again, store.kv[NOPE], batch)
    a, b, _ = segments[1]
    assert not torch.allclose(again[a:b].float(), out[a:b].float(), atol=2e-2)


def test_not_used_off_the_cpu_backend_or_with_a_page_the_kernel_cannot_take(streaming):
    from types import SimpleNamespace

    from kvstack.streaming import cpu_native

    assert not cpu_native.usable(SimpleNamespace(impl=object()))
    assert not cpu_native.fits(SimpleNamespace(impl=object()), 32)
    assert not cpu_native.fits(_layer(streaming), 8)  # no CPU kernel takes blocks of 8 tokens


def test_one_window_engine_matches_native(streaming, reference):
    assert tokens(streaming, [prompt(n, i) for i, n in enumerate(PROMPTS)]) == reference


def test_the_streaming_layers_device_window_is_never_written(streaming, reference, monkeypatch):
    """The hooks patch marks a paged layer (`Attention.kv_paged`) and vLLM no longer writes its
    K/V to its bounded device window, which nothing reads: the layer's only cache write per step is
    the connector's, to its host pages; the other layers still write their device caches. Control:
    the mark taken off, vLLM writes the device window again (the check can fail) and the tokens stay
    the same (the window is never read)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    layer = _layer(streaming)
    assert layer.kv_paged
    host = get_kv_transfer_group()._worker.store.kv[NOPE].data_ptr()
    impl_cls = type(layer.impl)
    writes: list[tuple[str, bool]] = []  # (layer, into the host tier)
    original = impl_cls.do_kv_cache_update

    def recording(self, lyr, key, value, kv_cache, slot_mapping):
        writes.append((lyr.layer_name, kv_cache.data_ptr() == host))
        return original(self, lyr, key, value, kv_cache, slot_mapping)

    monkeypatch.setattr(impl_cls, "do_kv_cache_update", recording)
    prompts = [prompt(n, i) for i, n in enumerate(PROMPTS)]
    assert tokens(streaming, prompts) == reference
    ours = [into_host for name, into_host in writes if name == NOPE]
    assert ours and all(ours), "the streaming layer's K/V went to its device window"
    assert any(name != NOPE and not into_host for name, into_host in writes)  # others: device
    writes.clear()
    monkeypatch.setattr(layer, "kv_paged", False)  # the control
    assert tokens(streaming, prompts) == reference
    assert (NOPE, False) in writes


def test_a_lone_request_reads_the_workers_table_in_place():
    """A decode step of one request (the common per-step case) gives the kernel a view of the
    worker's page table instead of a copy; several requests, or a table short of the pages the
    step needs (its sink pages), are copied into a new table as before: the same rows either way."""
    from kvstack.streaming import cpu_native
    from kvstack.streaming.layout import ReqStep

    P, pages = 32, [7, 3, 9, 1]
    array = torch.tensor(pages + [0] * 12, dtype=torch.int32)  # grown by doubling, as PageTables
    lone = ReqStep("a", 100, 1, 0, [], pages=pages, page_array=array[:4])
    b = cpu_native.kernel_batch([(0, 1, lone)], P)
    assert b.block_table.tolist() == [pages] and b.block_table.data_ptr() == array.data_ptr()
    assert b.query_start_loc.tolist() == [0, 1] and b.seq_lens.tolist() == [101]
    assert b.slot_mapping.tolist() == [pages[100 // P] * P + 100 % P]
    other = ReqStep("b", 40, 2, 0, [], pages=[5, 6], page_array=torch.tensor([5, 6], dtype=torch.int32))
    two = cpu_native.kernel_batch([(0, 1, lone), (1, 3, other)], P)
    assert two.block_table.tolist() == [pages, [5, 6, 0, 0]]
    assert two.block_table.data_ptr() != array.data_ptr()  # a copy
    assert two.query_start_loc.tolist() == [0, 1, 3] and two.seq_lens.tolist() == [101, 42]
    # the control: a table without the step's pages (a sink page past it) is not viewed
    sunk = ReqStep("c", 128, 1, 0, [], pages=pages + [15], page_array=array[:4])
    b = cpu_native.kernel_batch([(0, 1, sunk)], P)
    assert b.block_table.tolist() == [pages + [15]] and b.block_table.data_ptr() != array.data_ptr()
