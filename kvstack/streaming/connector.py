"""`StreamingConnector`: streaming attention + KV paging over a host tier, for vLLM's
KV-connector API as extended by kvstack's hooks patch.

Class level (before any instance exists): ``supports_kv_paging = True`` and
``get_kv_paging_window`` give each streaming layer a sliding-window KV spec of
``device_window_tokens``, so the device keeps only the blocks of the current step for it.

Scheduler side (`_SchedulerSide`, scheduler_side.py): owns the host-tier page table (`PagePool`): admission (a request
the tier cannot hold now, prompt + max_tokens, fails with a clear error through
``take_failed_requests``, or waits with ``on_host_tier_full="wait"``), page allocation per step, prefix reuse
(full prompt pages hashed and kept after the request finishes), freeing on finish. Each step's
metadata tells the worker, per scheduled request, its first position, token count, host pages and
the device slot of its first new token in the streaming group (how the worker finds the request
in the batch).

Worker side (`_WorkerSide`, worker_side.py): holds the K/V pools (`HostStore`) and computes the attention of the
streaming layers: host history in windows + the new tokens, merged by log-sum-exp; then appends
the new tokens' K/V to the host tier.

Usage: ``kv_transfer_config={"kv_connector": "StreamingConnector", "kv_role": "kv_both",
"kv_connector_module_path": "kvstack.streaming", "kv_connector_extra_config": {...}}``
(see `kvstack.streaming.config` for the keys).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from .config import StreamingConfig, selects_layer
from .layout import ReqStep, StreamingMetadata, _Layout, _layout  # noqa: F401 (re-exported)
from .scheduler_side import _SchedulerSide
from .worker_side import _WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class StreamingConnector(KVConnectorBase_V1, SupportsHMA):
    supports_kv_paging = True

    # ---- class level: consulted while the KV cache specs are collected ------------------
    @classmethod
    def get_kv_paging_window(cls, vllm_config: "VllmConfig", layer_name: str) -> int | None:
        cfg = StreamingConfig.from_vllm_config(vllm_config)
        if not selects_layer(cfg, vllm_config.model_config, layer_name):
            return None
        if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
            raise ValueError(
                "kvstack StreamingConnector needs the hybrid KV cache manager to bound the "
                "device KV of streaming layers. For chunked-local models (Llama-4) set "
                "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 and do not pass "
                "--disable-hybrid-kv-cache-manager.")
        if vllm_config.cache_config.enable_prefix_caching:
            raise ValueError(
                "kvstack StreamingConnector: disable vLLM's prefix caching "
                "(enable_prefix_caching=False / --no-enable-prefix-caching); the connector "
                "reuses prefixes from its host tier instead (streaming layers keep no device "
                "history to reuse).")
        return cfg.device_window_tokens

    # ---- construction ----------------------------------------------------------------------
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = StreamingConfig.from_vllm_config(vllm_config)
        self.layout = _layout(self.cfg, vllm_config, kv_cache_config)
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide(self.cfg, self.layout, vllm_config)
        else:
            self._worker = _WorkerSide(self.cfg, self.layout)

    # ---- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        pass  # the device KV of streaming layers is never read back

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StreamingMetadata)
        self._worker.begin_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # new K/V reach the host tier in compute_streaming_attention

    def wait_for_save(self):
        return

    def is_streaming_layer(self, layer_name: str) -> bool:
        return self._worker is not None and layer_name in self._worker.layers

    def compute_streaming_attention(self, layer, query, key, value, output, attn_metadata,
                                    kv_cache=None, **kwargs):
        if kwargs.get("output_scale") is not None or key is None or value is None:
            raise NotImplementedError(
                f"kvstack streaming: {layer.layer_name} needs quantized output or a shared KV "
                "cache, which streaming attention does not support; exclude it with "
                "'streaming_layers'")
        return self._worker.attention(layer, query, key, value, output, attn_metadata)

    # ---- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: Any,
                                 num_external_tokens: int):
        self._sched.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._sched.build_meta(scheduler_output)

    def take_failed_requests(self) -> dict[str, str]:
        return self._sched.take_failed() if self._sched is not None else {}

    def request_finished(self, request: "Request", block_ids: list[int]):
        self._sched.finish(request.request_id)
        return False, None

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]):
        self._sched.finish(request.request_id)
        return False, None

    # ---- observability -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Host-tier counters (scheduler side)."""
        return self._sched.stats() if self._sched is not None else {}
