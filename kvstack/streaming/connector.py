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

Observability (metrics.py): ``stats()`` in process; on a server, the host tier's gauges and
counters reach ``/metrics`` (``vllm:kvstack_*``) through vLLM's KV-connector stats API
(``get_kv_connector_stats``, ``build_kv_connector_stats``, ``build_prom_metrics``).

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

from .compat import align_cpu_attention_isa
from .config import StreamingConfig, selects_layer
from .layout import ReqStep, StreamingMetadata, _Layout, _layout  # noqa: F401 (re-exported)
from .log import logger
from .metrics import StatsReporter, StreamingConnectorStats, StreamingPromMetrics
from .scheduler_side import _SchedulerSide
from .scratch import plan_for
from .validate import check_device_budget, check_engine, check_layers
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
        check_engine(vllm_config)  # refused here, in every worker, before any KV is allocated
        return cfg.device_window_tokens

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Always: the connector computes a streaming layer's attention in Python, so attention
        must run between CUDA graph pieces, never inside a captured graph (vLLM then turns its
        GPU default FULL_AND_PIECEWISE into PIECEWISE; validate.check_engine refuses what is
        still unsafe)."""
        return True

    @classmethod
    def get_device_scratch_bytes(cls, vllm_config: "VllmConfig") -> int:
        """Device memory the windowed path allocates after vLLM's memory profiling (staging
        buffers, attention temporaries; scratch.py), which kvstack's gpu_worker patch takes out
        of the KV cache memory before the cache is allocated."""
        return plan_for(vllm_config).total

    # ---- construction ----------------------------------------------------------------------
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = StreamingConfig.from_vllm_config(vllm_config)
        check_engine(vllm_config)
        self.layout = _layout(self.cfg, vllm_config, kv_cache_config)
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            check_device_budget(vllm_config, kv_cache_config)
            self._sched = _SchedulerSide(self.cfg, self.layout, vllm_config)
            self._reporter = StatsReporter()
        else:
            self._worker = _WorkerSide(self.cfg, self.layout)

    # ---- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        # The device KV of streaming layers is never read back. The model is loaded now: check
        # its attention layers before the engine serves, then pick the path from their backend
        # and open the host tier (worker_side.prepare).
        changed = align_cpu_attention_isa(
            self._vllm_config, self._vllm_config.compilation_config.static_forward_context)
        if changed:
            logger.warning("kvstack streaming: vLLM's CPU attention ISA re-picked for the KV cache's "
                           "%d-token blocks in %d layer(s) (its AMX kernel needs 32-token blocks)",
                           self._vllm_config.cache_config.block_size, len(changed))
        check_layers(self._vllm_config, self.layout, self.cfg)
        device = next((t.device for t in kv_caches.values() if isinstance(t, torch.Tensor)), None)
        self._worker.prepare(self._vllm_config, device)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # The step starts when its metadata is bound, before the forward, on every vLLM:
        # start_load_kv is no place for it (vLLM 0.32 calls it after the forward on steps
        # without synchronous KV loads).
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, StreamingMetadata)
            self._worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        return  # nothing to load: the step began in bind_connector_metadata

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # new K/V reach the host tier in compute_streaming_attention

    def wait_for_save(self):
        self._worker.end_step()  # every streaming layer was computed by the connector

    def is_streaming_layer(self, layer_name: str) -> bool:
        return self._worker is not None and layer_name in self._worker.layers

    def compute_streaming_attention(self, layer, query, key, value, output, attn_metadata,
                                    kv_cache=None, **kwargs):
        if kwargs.get("output_scale") is not None or key is None or value is None:
            raise NotImplementedError(
                f"kvstack streaming: {layer.layer_name} needs quantized output or a shared KV "
                "cache, which streaming attention does not support; exclude it with "
                "'streaming_layers'")
        if query.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"kvstack streaming: {layer.layer_name} is being captured in a CUDA graph; its "
                "attention runs in the connector and cannot be captured. Use cudagraph_mode "
                "PIECEWISE (attention among the splitting ops) or enforce_eager.")
        return self._worker.attention(layer, query, key, value, output, attn_metadata)

    # ---- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_hit_alignment(self) -> int:
        """Hits end where a page and every local chunk end (MultiConnector's joint hits)."""
        return self.layout.reuse_granule or self.cfg.page_tokens

    def update_state_after_alloc(self, request: "Request", blocks: Any,
                                 num_external_tokens: int):
        self._sched.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._sched.build_meta(scheduler_output)

    def take_failed_requests(self) -> dict[str, str]:
        return self._sched.take_failed() if self._sched is not None else {}

    def reset_cache(self) -> bool | None:
        """vLLM's reset_prefix_cache(reset_connector=True): no cached prefix is reused after it
        (scheduler side; the worker's pages simply become unreachable)."""
        return self._sched.reset_cache() if self._sched is not None else None

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

    def get_kv_connector_stats(self) -> "StreamingConnectorStats | None":
        """This step's host-tier stats for vLLM's stats path (scheduler side; see metrics.py):
        gauges now, counter increments since the last call, or None when nothing changed."""
        if self._sched is None:
            return None
        return self._reporter.take(self._sched.stats())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> StreamingConnectorStats:
        data = data or {}
        return StreamingConnectorStats(data={"gauges": dict(data.get("gauges", {})),
                                             "counters": dict(data.get("counters", {}))})

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> StreamingPromMetrics:
        return StreamingPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _register_by_name() -> None:
    """vLLM's MultiConnector rebuilds its children's stats by their registered names
    (KVConnectorFactory.get_connector_class_by_name), which knows only vLLM's own connectors, not
    one loaded through kv_connector_module_path. Without this, `vllm serve` with this connector
    under a MultiConnector lost its output handler at the first stats update (vLLM 0.32.0 and
    0.25.1: "Connector 'StreamingConnector' is not registered", every request then HTTP 500).
    Upstream: vllm#57683 (open) would skip unregistered children's stats instead."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector("StreamingConnector", __name__, "StreamingConnector")
    except ValueError:  # already registered (this module imported again, or by vLLM itself)
        pass


_register_by_name()
