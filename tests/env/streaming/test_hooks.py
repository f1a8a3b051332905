"""The hooks patch: defaults change nothing, the decorator diverts only streaming layers."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from streaming_helpers import ROOT, needs_hooks

PATCH_GLOB = "*kv_connector-streaming-attention-and-KV-pagi*.patch"


def _patches():
    """The hooks patch: in the integrated series (patches/vllm/) or its build folder."""
    from kvstack.release.pins import load_pin

    for d in (load_pin("vllm").series_dir,):
        found = sorted(d.glob(PATCH_GLOB))
        if found:
            return found
    pytest.skip("streaming hooks patch not found")


def test_series_has_one_patch_with_trailers():
    (p,) = _patches()
    text = p.read_text()
    assert "Subject: [PATCH] [kvstack] kv_connector: streaming-attention and KV-paging" in text
    for trailer in ("Upstream-Status: Pending", "Drop-When:", "Kvstack-Issue: 4"):
        assert trailer in text
    assert "From: kvstack <kvstack@localhost>" in text


def test_hooks_are_applied():
    from streaming_helpers import hooks_applied

    assert hooks_applied(), "the streaming hooks patch is not applied to this vLLM: run `make env`"


@needs_hooks
def test_base_defaults():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert KVConnectorBase_V1.supports_kv_paging is False
    assert KVConnectorBase_V1.get_kv_paging_window(None, "model.layers.0.self_attn.attn") is None
    assert KVConnectorBase_V1.is_streaming_layer(object(), "x") is False
    assert KVConnectorBase_V1.compute_streaming_attention(
        object(), None, None, None, None, None, None) is None
    for name in ("is_streaming_layer", "compute_streaming_attention", "get_kv_paging_window"):
        assert getattr(KVConnectorBase_V1, name).__doc__


def _fake_connector(streaming: set[str], handled: bool):
    calls = []

    class Fake:
        def has_connector_metadata(self):
            return True

        def wait_for_layer_load(self, name):
            calls.append(("wait", name))

        def save_kv_layer(self, name, kv, md):
            calls.append(("save", name))

        def is_streaming_layer(self, name):
            return name in streaming

        def compute_streaming_attention(self, layer, query, key, value, output, attn_metadata,
                                        kv_cache=None, **kw):
            calls.append(("stream", layer, float(query.sum()), sorted(kw)))
            if not handled:
                return None
            output.fill_(7.0)
            return output

    return Fake(), calls


def _decorated(monkeypatch, connector):
    from vllm.model_executor.layers.attention import attention as attn_mod
    from vllm.model_executor.layers.attention import kv_transfer_utils as ktu

    monkeypatch.setattr(ktu, "has_kv_transfer_group", lambda: connector is not None)
    monkeypatch.setattr(ktu, "is_v1_kv_transfer_group", lambda: True)
    monkeypatch.setattr(ktu, "get_kv_transfer_group", lambda: connector)
    monkeypatch.setattr(attn_mod, "get_attention_context",
                        lambda name: ("md", f"layer:{name}", "kv", None))
    native = []

    @ktu.maybe_transfer_kv_layer
    def op(query, key, value, output, layer_name, output_scale=None, kv_cache_dummy_dep=None):
        native.append(layer_name)
        output.fill_(1.0)

    return op, native


@needs_hooks
@pytest.mark.parametrize("handled", [True, False])
def test_decorator_diverts_only_streaming_layers(monkeypatch, handled):
    conn, calls = _fake_connector({"L3"}, handled)
    op, native = _decorated(monkeypatch, conn)
    q = torch.ones(2, 4, 8)
    for name in ("L0", "L3"):
        out = torch.zeros(2, 4, 8)
        op(q, q, q, out, name)
        expect = 7.0 if (name == "L3" and handled) else 1.0
        assert torch.all(out == expect)
    assert native == (["L0"] if handled else ["L0", "L3"])
    streams = [c for c in calls if c[0] == "stream"]
    assert streams == [("stream", "layer:L3", 64.0, ["kv_cache_dummy_dep", "output_scale"])]
    # wait/save still bracket every layer, streaming or not
    assert [c for c in calls if c[0] != "stream"] == [
        ("wait", "L0"), ("save", "L0"), ("wait", "L3"), ("save", "L3")]


@needs_hooks
def test_streaming_calls_bind_their_arguments_as_inspect_does():
    """The hook binds a streaming layer's arguments per call without inspect's cost
    (`_bound_arguments`): the same dict as `sig.bind(...)` + `apply_defaults()` for positional,
    keyword and defaulted arguments, keyword-only and variadic signatures (which take
    inspect's path), and the same TypeError for a call that does not fit (the control: a
    missing, repeated, unknown or extra argument)."""
    import inspect

    from vllm.model_executor.layers.attention import kv_transfer_utils as ktu

    def op(query, key, value, output, layer_name, output_scale=None, output_block_scale=None):
        pass

    def kwonly(query, output, *, layer_name, extra=1):
        pass

    def varargs(query, *rest, output=None):
        pass

    def by_inspect(sig, args, kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    sig = inspect.signature(op)
    for s, args, kwargs in [
            (sig, (1, 2, 3, 4, "l"), {}), (sig, (1, 2, 3, 4), {"layer_name": "l"}),
            (sig, (1, 2, 3, 4, "l", 5), {"output_block_scale": 6}),
            (sig, (), dict(query=1, key=2, value=3, output=4, layer_name="l")),
            (inspect.signature(kwonly), (1, 2), {"layer_name": "x"}),
            (inspect.signature(varargs), (1, 2, 3), {"output": 4})]:
        assert ktu._bound_arguments(s, args, kwargs) == by_inspect(s, args, kwargs)
    for args, kwargs in [((1, 2, 3, 4), {}), ((1, 2, 3, 4, "l"), {"query": 9}),
                         ((1, 2, 3, 4, "l"), {"nope": 1}), ((1, 2, 3, 4, 5, 6, 7, 8), {})]:
        with pytest.raises(TypeError):
            ktu._bound_arguments(sig, args, kwargs)


@needs_hooks
def test_connector_without_hooks_is_unchanged(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    calls = []

    class Plain(KVConnectorBase_V1):  # a connector written before the hooks existed
        def __init__(self):
            self._connector_metadata = object()

        def start_load_kv(self, *a, **k): pass
        def wait_for_layer_load(self, name): calls.append(("wait", name))
        def save_kv_layer(self, name, kv, md, **k): calls.append(("save", name))
        def wait_for_save(self): pass
        def get_num_new_matched_tokens(self, *a): return 0, False
        def update_state_after_alloc(self, *a): pass
        def build_connector_meta(self, *a): return None

    op, native = _decorated(monkeypatch, Plain())
    q = torch.ones(2, 4, 8)
    for name in ("L0", "L3"):
        op(q, q, q, torch.zeros(2, 4, 8), name)
    assert native == ["L0", "L3"]
    assert calls == [("wait", "L0"), ("save", "L0"), ("wait", "L3"), ("save", "L3")]


@needs_hooks
def test_kv_paging_window_only_for_capable_connectors(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.model_executor.layers.attention.kv_transfer_utils import get_kv_paging_window

    class NoPaging(KVConnectorBase_V1):
        @classmethod
        def get_kv_paging_window(cls, vllm_config, layer_name):
            return 64  # ignored: the class does not declare supports_kv_paging

    class Paging(KVConnectorBase_V1):
        supports_kv_paging = True

        @classmethod
        def get_kv_paging_window(cls, vllm_config, layer_name):
            return 64 if layer_name.endswith("3.attn") else None

    cfg = SimpleNamespace(kv_transfer_config=None)
    assert get_kv_paging_window(cfg, "layers.3.attn") is None
    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_transfer_instance=True))
    for cls, expect in ((NoPaging, (None, None)), (Paging, (64, None))):
        monkeypatch.setattr(KVConnectorFactory, "get_connector_class",
                            classmethod(lambda c, ktc, _cls=cls: _cls))
        assert (get_kv_paging_window(cfg, "layers.3.attn"),
                get_kv_paging_window(cfg, "layers.0.attn")) == expect
