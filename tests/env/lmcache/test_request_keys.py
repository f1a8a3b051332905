"""A request's `cache_salt` and LoRA adapter in its LMCache chunk keys (issue 27, point 3).

kvstack's LMCache patch "vLLM adapter: a request's cache_salt and LoRA adapter in its chunk keys"
(0013 on 0.32, 0010 on 0.25) gives the in-process adapter's key configs two tags besides the
request's `lmcache.tag.*` kv_transfer_params: `lmcache.tag.salt` (a digest of `cache_salt`) and
`lmcache.tag.lora` (a digest of the adapter's name and path). `CacheEngineKey` holds the tags, so
chunk keys, and the hybrid state keys made from them, differ where vLLM's own prefix cache keeps
requests apart. Unit level, no engine: the helper, the request tracker the scheduler side makes
from vLLM's real `Request` / `NewRequestData`, and the keys. Through `vllm serve` the salt is
checked end to end by tests/env/server/test_cross_engine_server.py
(`test_another_cache_salt_does_not_share`). LoRA is checked here only: the tiny test models have
no adapters, so there is no engine-level LoRA test.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("lmcache")

import torch  # noqa: E402
from lmcache.integration.vllm import vllm_v1_adapter as adapter  # noqa: E402
from lmcache.integration.vllm.hybrid_state import state_key  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import NewRequestData  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

pytestmark = pytest.mark.env

SALT, LORA = "lmcache.tag.salt", "lmcache.tag.lora"


def configs(salt=None, lora=None, kv_transfer_params=None):
    sp = SamplingParams(max_tokens=4)
    if kv_transfer_params is not None:
        sp.extra_args = {"kv_transfer_params": kv_transfer_params}
    return adapter.key_request_configs(sp, salt, lora)


def key(request_configs, chunk_hash=0x1234) -> CacheEngineKey:
    return CacheEngineKey("tiny-llama", 1, 0, chunk_hash, torch.bfloat16,
                          request_configs=request_configs)


def test_same_salt_same_configs_other_salt_other_configs():
    a = configs("tenant-a")
    assert a == configs("tenant-a")
    assert set(a) == {SALT}
    assert a != configs("tenant-b")
    assert key(a) == key(configs("tenant-a"))
    assert key(a) != key(configs("tenant-b"))
    assert key(a) != key(None)


def test_no_salt_no_tag_keys_as_before():
    assert configs() is None
    assert configs("") is None  # vLLM treats an empty salt as none
    assert key(configs()) == key(None)
    assert key(configs()).to_string() == "tiny-llama@1@0@" + key(None).chunk_hash_hex + "@bfloat16"


def test_salt_is_a_digest_in_key_names():
    salt = "tenant@a%secret"
    k = key(configs(salt)).to_string()
    assert salt not in k and "secret" not in k
    tag = k.split("@")[5]
    name, value = tag.split("%")
    assert name == "salt" and len(value) == 32 and int(value, 16) >= 0
    assert CacheEngineKey.from_string(k) == key(configs(salt))  # survives a backend's key names


def test_lora_adapter_is_a_tag():
    a = LoRARequest("adapter-a", 1, "/adapters/a")
    cfg = configs(lora=a)
    assert set(cfg) == {LORA}
    # name and path, not lora_int_id (a server numbers adapters per process)
    assert cfg == configs(lora=LoRARequest("adapter-a", 7, "/adapters/a"))
    assert cfg != configs(lora=LoRARequest("adapter-b", 1, "/adapters/a"))
    assert cfg != configs(lora=LoRARequest("adapter-a", 1, "/adapters/a2"))
    assert key(cfg) != key(None)
    both = configs("tenant-a", a)
    assert set(both) == {SALT, LORA} and both[SALT] == configs("tenant-a")[SALT]


def test_request_tags_kept_reserved_tags_replaced():
    params = {"lmcache.tag.user": "u1", "lmcache.skip_save": False, SALT: "forged",
              LORA: "forged", "disagg_spec": None}
    cfg = configs("tenant-a", kv_transfer_params=params)
    assert cfg == {"lmcache.tag.user": "u1", "lmcache.skip_save": False,
                   SALT: configs("tenant-a")[SALT]}
    # no salt: a request cannot name another tenant's salt tag itself
    assert configs(kv_transfer_params=params) == {"lmcache.tag.user": "u1",
                                                  "lmcache.skip_save": False}


def _request(req_id: str, salt=None, lora=None) -> Request:
    return Request(req_id, list(range(3, 103)), SamplingParams(max_tokens=4), None,
                   lora_request=lora, cache_salt=salt)


def test_lookup_and_store_sides_agree():
    """The lookup side keys by the vLLM `Request` (get_num_new_matched_tokens), the store side by
    the tracker build_connector_meta makes from `NewRequestData` (which has no `cache_salt`) and
    the salt of the `Request` update_state_after_alloc kept: the same configs."""
    lora = LoRARequest("adapter-a", 1, "/adapters/a")
    for salt, lo in [("tenant-a", None), (None, lora), ("tenant-a", lora), (None, None)]:
        req = _request("r", salt, lo)
        new = NewRequestData.from_request(req, ([0, 1, 2, 3],))
        assert not hasattr(new, "cache_salt")
        tracker = adapter.RequestTracker.from_new_request(None, new, 64, 0, False,
                                                          cache_salt=req.cache_salt)
        assert tracker.request_configs == adapter.request_key_configs(req)
        assert tracker.request_configs == configs(salt, lo)


def test_hybrid_state_keys_keep_the_tags():
    a, b = key(configs("tenant-a")), key(configs("tenant-b"))
    assert state_key(a).tags == a.tags
    assert state_key(a) != state_key(b)
    assert state_key(a) != state_key(key(None))
    assert state_key(a).chunk_hash == state_key(b).chunk_hash  # only the tag differs
