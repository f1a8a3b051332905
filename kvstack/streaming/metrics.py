"""The streaming connector's counters on vLLM's stats path and on a server's ``/metrics``.

vLLM 0.25.1's KV-connector stats API, as the streaming connector uses it:

- Scheduler side, once per engine step: ``StreamingConnector.get_kv_connector_stats()`` returns a
  `StreamingConnectorStats` built by `StatsReporter.take` from the host tier's current state, or
  ``None`` when nothing changed since the last step. The scheduler puts its ``data`` dict into
  ``SchedulerStats.kv_connector_stats``, which travels to the API server process.
- There, vLLM rebuilds the object with ``StreamingConnector.build_kv_connector_stats(data)``:
  its log line ("KV Transfer metrics: ...", every ``--log-stats`` interval) aggregates the steps
  of the interval; and `StreamingPromMetrics.observe` (from ``build_prom_metrics``) records each
  step's data into Prometheus.

``data`` = ``{"gauges": {name: value}, "counters": {name: delta}}``. Gauges are the host tier's
state at the end of the step (the later value wins when two are aggregated); counters are
increments since the previous report, so summing them, in an interval's aggregate or into a
Prometheus counter, never counts anything twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

# stats() key -> (Prometheus name, help). Gauges: the state now.
GAUGES: dict[str, tuple[str, str]] = {
    "pages_total": ("vllm:kvstack_host_tier_pages",
                    "kvstack StreamingConnector: pages in the host tier (capacity)."),
    "pages_in_use": ("vllm:kvstack_host_tier_pages_in_use",
                     "kvstack StreamingConnector: host-tier pages held by running requests."),
    "cached_pages": ("vllm:kvstack_host_tier_pages_cached",
                     "kvstack StreamingConnector: host-tier pages of finished requests kept "
                     "for prefix reuse (evictable)."),
    "live_requests": ("vllm:kvstack_host_tier_requests",
                      "kvstack StreamingConnector: requests holding host-tier pages."),
    "waiting_requests": ("vllm:kvstack_host_tier_waiting_requests",
                         "kvstack StreamingConnector: requests waiting in line for host-tier "
                         "room (on_host_tier_full='wait')."),
}
# stats() key -> (Prometheus name, help). Counters: cumulative, reported as increments.
# (prometheus_client appends "_total" to a counter's name in the exposition.)
COUNTERS: dict[str, tuple[str, str]] = {
    "prefix_hit_tokens": ("vllm:kvstack_prefix_hit_tokens",
                          "kvstack StreamingConnector: prompt tokens served from host-tier "
                          "pages of earlier requests (prefix reuse)."),
    "prefix_hit_requests": ("vllm:kvstack_prefix_hit_requests",
                            "kvstack StreamingConnector: requests that reused a cached prefix."),
    "failed_host_tier_full": ("vllm:kvstack_host_tier_full_failed_requests",
                              "kvstack StreamingConnector: requests failed because the host "
                              "tier was full (at admission with on_host_tier_full='fail', or "
                              "decoding past their reservation)."),
    "evicted_pages": ("vllm:kvstack_host_tier_evicted_pages",
                      "kvstack StreamingConnector: cached pages evicted to make room."),
    "cache_resets": ("vllm:kvstack_cache_resets",
                     "kvstack StreamingConnector: prefix cache resets (reset_prefix_cache with "
                     "the connector): nothing cached before one is reused after it."),
    "reset_dropped_pages": ("vllm:kvstack_cache_reset_dropped_pages",
                            "kvstack StreamingConnector: cached host-tier pages dropped by "
                            "prefix cache resets."),
    "waited_for_space": ("vllm:kvstack_host_tier_waits",
                         "kvstack StreamingConnector: scheduling attempts a request waited "
                         "because the host tier had no room for it (on_host_tier_full='wait')."),
    "wait_timeouts": ("vllm:kvstack_host_tier_wait_timeouts",
                      "kvstack StreamingConnector: requests failed after waiting "
                      "wait_timeout_s for host-tier room."),
    "resumed_reuse_requests": ("vllm:kvstack_resumed_reuse_requests",
                               "kvstack StreamingConnector: requests resumed after preemption "
                               "that reused the host-tier pages they held."),
    "resumed_reuse_tokens": ("vllm:kvstack_resumed_reuse_tokens",
                             "kvstack StreamingConnector: tokens a resumed request did not "
                             "recompute (its own host-tier pages)."),
}


@dataclass
class StreamingConnectorStats(KVConnectorStats):
    """One or more steps of host-tier stats (serializable: ``data`` holds ints only)."""

    def __post_init__(self):
        if not self.data:
            self.reset()
        self.data.setdefault("gauges", {})
        self.data.setdefault("counters", {})

    def reset(self):
        self.data = {"gauges": {}, "counters": {}}

    def is_empty(self) -> bool:
        return not self.data["gauges"] and not any(self.data["counters"].values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Fold `other` (later steps) into this one: gauges take its values, counters add."""
        if other is None or other.is_empty():
            return self
        self.data["gauges"].update(other.data.get("gauges", {}))
        counters = self.data["counters"]
        for name, delta in other.data.get("counters", {}).items():
            counters[name] = counters.get(name, 0) + delta
        return self

    def reduce(self) -> dict[str, int | float]:
        return {**self.data["gauges"], **self.data["counters"]}


class StatsReporter:
    """Turns successive `_SchedulerSide.stats()` snapshots into per-step stats objects."""

    _NAMES = (*GAUGES, *COUNTERS)

    def __init__(self):
        self._last: tuple | None = None  # the values of _NAMES at the last report
        self._counters = {name: 0 for name in COUNTERS}

    def take(self, snapshot: dict[str, Any]) -> StreamingConnectorStats | None:
        values = tuple(snapshot[name] for name in self._NAMES)
        if values == self._last:
            return None  # nothing new since the last step (most steps: one tuple compare)
        self._last = values
        gauges = {name: int(snapshot[name]) for name in GAUGES}
        now = {name: int(snapshot[name]) for name in COUNTERS}
        deltas = {k: v - self._counters[k] for k, v in now.items() if v != self._counters[k]}
        self._counters = now
        return StreamingConnectorStats(data={"gauges": gauges, "counters": deltas})


class StreamingPromMetrics(KVConnectorPromMetrics):
    """Registers the gauges and counters above, labelled per engine like vLLM's own metrics."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.gauges: dict[str, dict[int, Any]] = {}
        self.counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in GAUGES.items():
            gauge = self._gauge_cls(name=name, documentation=doc, labelnames=labelnames,
                                    multiprocess_mode="mostrecent")
            self.gauges[key] = self._per_engine(gauge)
        for key, (name, doc) in COUNTERS.items():
            counter = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self.counters[key] = self._per_engine(counter)

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        if not transfer_stats_data:
            return
        for key, value in transfer_stats_data.get("gauges", {}).items():
            if key in self.gauges:
                self.gauges[key][engine_idx].set(value)
        for key, delta in transfer_stats_data.get("counters", {}).items():
            if key in self.counters and delta > 0:
                self.counters[key][engine_idx].inc(delta)
