"""The streaming connector's stats on vLLM's KV-connector stats path (kvstack/streaming/metrics.py),
without an engine: per-step reports, aggregation over log intervals, Prometheus recording.
The server end to end (the same metrics on /metrics) is tests/env/server/test_streaming_server.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstack.streaming.metrics import (
    COUNTERS,
    GAUGES,
    StatsReporter,
    StreamingConnectorStats,
    StreamingPromMetrics,
)


def snapshot(**kw):
    base = {name: 0 for name in (*GAUGES, *COUNTERS)}
    base.update(pages_total=100)
    base.update(kw)
    return base


# A run of the scheduler side: (step snapshot) as _SchedulerSide.stats() would give them.
STEPS = [
    snapshot(pages_in_use=10, live_requests=1),
    snapshot(pages_in_use=10, live_requests=1),  # nothing changed: no report
    snapshot(pages_in_use=30, live_requests=2, prefix_hit_tokens=64, prefix_hit_requests=1),
    snapshot(pages_in_use=20, cached_pages=8, live_requests=1, prefix_hit_tokens=64,
             prefix_hit_requests=1, failed_host_tier_full=1),
    snapshot(pages_in_use=0, cached_pages=16, prefix_hit_tokens=128, prefix_hit_requests=2,
             failed_host_tier_full=1, evicted_pages=3),
    snapshot(pages_in_use=0, cached_pages=16, prefix_hit_tokens=128, prefix_hit_requests=2,
             failed_host_tier_full=1, evicted_pages=3),  # idle step: no report
]


def reports():
    rep = StatsReporter()
    return [rep.take(s) for s in STEPS]


def test_reporter_sends_gauges_and_counter_increments_only_on_change():
    out = reports()
    assert out[1] is None and out[5] is None
    first = out[0].data
    assert first["gauges"] == {"pages_total": 100, "pages_in_use": 10, "cached_pages": 0,
                               "live_requests": 1, "waiting_requests": 0}
    assert first["counters"] == {}
    assert out[2].data["counters"] == {"prefix_hit_tokens": 64, "prefix_hit_requests": 1}
    assert out[3].data["counters"] == {"failed_host_tier_full": 1}  # increments, not totals
    # A gauge falling to 0 is reported (pages freed when the last request finished).
    assert out[4].data["gauges"]["pages_in_use"] == 0
    assert out[4].data["counters"] == {"prefix_hit_tokens": 64, "prefix_hit_requests": 1,
                                       "evicted_pages": 3}


def test_aggregate_over_any_interval_split_matches_the_totals():
    from kvstack.streaming.connector import StreamingConnector

    sent = [r.data for r in reports() if r is not None]
    last = STEPS[-1]
    for split in range(1, len(sent)):  # two log intervals, cut anywhere
        totals = {name: 0 for name in COUNTERS}
        for interval in (sent[:split], sent[split:]):
            acc = None
            for data in interval:  # what vLLM's KVConnectorLogging.observe does per step
                s = StreamingConnector.build_kv_connector_stats(data)
                acc = s if acc is None else acc.aggregate(s)
            reduced = acc.reduce()
            for name in COUNTERS:
                totals[name] += reduced.get(name, 0)
        assert totals == {name: last[name] for name in COUNTERS}
        assert reduced["pages_in_use"] == 0 and reduced["cached_pages"] == 16


def test_stats_object_basics():
    assert StreamingConnectorStats().is_empty()
    assert StreamingConnectorStats(data={"gauges": {}, "counters": {"evicted_pages": 0}}).is_empty()
    s = StreamingConnectorStats(data={"gauges": {"pages_in_use": 1}, "counters": {}})
    assert not s.is_empty()
    assert s.aggregate(StreamingConnectorStats()) is s
    s.reset()
    assert s.is_empty()


@pytest.fixture
def prom():
    reg = CollectorRegistry()

    def bind(cls):
        return lambda **kw: cls(registry=reg, **kw)

    metric_types = {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)}
    labels = {0: ["m", "0"], 1: ["m", "1"]}
    m = StreamingPromMetrics(SimpleNamespace(kv_transfer_config=None), metric_types,
                             ["model_name", "engine"], labels)
    return m, reg


def test_prometheus_counters_equal_cumulative_values_gauges_the_last(prom):
    m, reg = prom
    for r in reports():
        if r is not None:
            m.observe(r.data, engine_idx=1)
    last = STEPS[-1]

    def value(name, engine="1"):
        return reg.get_sample_value(name, {"model_name": "m", "engine": engine})

    for key, (name, _) in COUNTERS.items():
        assert value(name + "_total") == last[key], name
        assert value(name + "_total", engine="0") == 0  # the other engine's series untouched
    for key, (name, _) in GAUGES.items():
        assert value(name) == last[key], name
    m.observe({}, engine_idx=1)  # empty data: nothing recorded, nothing raised
    assert value("vllm:kvstack_prefix_hit_tokens_total") == 128
