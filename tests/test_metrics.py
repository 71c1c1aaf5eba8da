"""engine/metrics.py's publication order, with a stand-in for Triton's metrics API that logs
each increment (the real one is exercised through tritonserver in tests/test_serving.py)."""
import pytest

from engine.metrics import ServingMetrics, TritonMetrics, instance_labels
from engine.outputs import EngineStats


class _FakePbUtils:
    """MetricFamily / Metric as pb_utils has them; every increment and set is logged."""

    def __init__(self):
        log = self.log = []
        increments = self.increments = []      # (name, labels, value)

        class Metric:
            def __init__(self, family, labels):
                self.name, self.labels = family.name, labels

            def increment(self, value):
                log.append((self.name, self.labels.get("reason"), value))
                increments.append((self.name, self.labels, value))

            def set(self, value):
                log.append((self.name, None, value))

        class MetricFamily:
            COUNTER, GAUGE = "counter", "gauge"

            def __init__(self, name, description, kind):
                self.name = name

            def Metric(self, labels):  # noqa: N802 - pb_utils' name
                return Metric(self, labels)

        self.MetricFamily = MetricFamily


def test_a_request_counted_finished_is_published_after_its_latencies():
    pb = _FakePbUtils()
    published = TritonMetrics(pb, {"model": "llm", "version": "1"})
    m = ServingMetrics()
    m.on_first_token(0.02)          # the serving code observes latencies first,
    m.on_inter_token(0.01, 5)
    m.on_request_done(0.07)
    m.on_tokens(10, 6)
    m.on_finish("length")           # then counts the request finished
    published.publish(m)
    names = [name for name, _, _ in pb.log]
    finished = names.index("llm_requests_finished_total")
    for family in ("llm_time_to_first_token_seconds_count",
                   "llm_inter_token_latency_seconds_count",
                   "llm_e2e_request_latency_seconds_count",
                   "llm_time_to_first_token_seconds_bucket"):
        assert names.index(family) < finished, family
    assert ("llm_requests_finished_total", "length", 1) in pb.log
    assert ("llm_e2e_request_latency_seconds_sum", None, 0.07) in pb.log
    pb.log.clear()
    published.publish(m)            # nothing changed: nothing sent again but the two gauges
    assert [e for e in pb.log if e[0] not in ("llm_event_loop_lag_max_seconds",   # set each time
                                              "llm_prefix_routing_peers")] == []


def test_a_scrape_between_two_increments_sees_cumulative_buckets():
    """Each increment is a round trip to the server, and a scrape may fall between any two:
    after every one, the buckets must not fall as le rises, and +Inf and _count may differ by
    that one increment at most. Buckets raised lowest first broke it whenever a request landed
    in a bucket whose neighbours held the same count (the usual case)."""
    pb = _FakePbUtils()
    published = TritonMetrics(pb, {"model": "llm", "version": "1"})
    m = ServingMetrics()
    for value in (0.0005, 0.0005, 0.3, 4.0):       # low buckets level with the ones above
        m.on_first_token(value)
        published.publish(m)
    seen: dict[str, float] = {}
    bucket = "llm_time_to_first_token_seconds_bucket"
    checked = 0
    for name, labels, value in pb.increments:
        key = labels.get("le", name) if name == bucket else name
        seen[key] = seen.get(key, 0) + value
        if not name.startswith("llm_time_to_first_token_seconds"):
            continue
        les = sorted((k for k in seen if k[0].isdigit() or k == "+Inf"),
                     key=lambda le: float("inf") if le == "+Inf" else float(le))
        counts = [seen[le] for le in les]
        assert counts == sorted(counts), dict(zip(les, counts))
        if "+Inf" in seen:
            assert abs(seen["+Inf"] - seen.get("llm_time_to_first_token_seconds_count", 0)) <= 1
        checked += 1
    assert checked > 10 and seen["+Inf"] == seen["llm_time_to_first_token_seconds_count"] == 4


def _stats(num_steps: int) -> EngineStats:
    return EngineStats(num_running=0, num_waiting=0, num_kv_blocks=64, num_free_kv_blocks=64,
                       num_cached_kv_blocks=0, num_steps=num_steps, num_prompt_tokens=10,
                       num_computed_prompt_tokens=10, num_cached_prompt_tokens=0,
                       num_generated_tokens=6, num_preemptions=0, num_graph_steps=num_steps // 2)


def test_engine_steps_go_out_before_the_finished_requests_of_the_cut():
    """The serving loop reads the counters (the cut), then fetches the engine's stats: a scrape
    that shows a request finished must show the steps that produced its tokens, so the stats
    are published first, and a request that finished after the cut waits for the next call."""
    pb = _FakePbUtils()
    published = TritonMetrics(pb, {"model": "llm", "version": "1"})
    m = ServingMetrics()
    m.on_tokens(10, 6)
    m.on_finish("length")
    cut = m.snapshot()
    m.on_finish("stop")             # after the cut: not in this publication
    m.on_stats(_stats(7))           # fetched after the cut: counts the first request's steps
    published.publish(m, cut)
    names = [name for name, _, _ in pb.log]
    finished = names.index("llm_requests_finished_total")
    for family in ("llm_engine_steps_total", "llm_engine_graph_steps_total", "llm_num_requests_running"):
        assert names.index(family) < finished, family
    assert ("llm_engine_steps_total", None, 7) in pb.log
    assert [e for e in pb.log if e[0] == "llm_requests_finished_total"] == [
        ("llm_requests_finished_total", "length", 1)]
    pb.log.clear()
    published.publish(m)            # the next call takes its own cut: the later request now
    assert [e for e in pb.log if e[0] == "llm_requests_finished_total"] == [
        ("llm_requests_finished_total", "stop", 1)]


def test_prefix_cache_counters_go_out_as_deltas_queries_before_hits():
    pb = _FakePbUtils()
    published = TritonMetrics(pb, {"model": "llm", "version": "1"})
    m = ServingMetrics()
    for prompt, cached in ((100, 0), (250, 96), (250, 96)):
        m.on_stats(EngineStats(num_running=0, num_waiting=0, num_kv_blocks=64,
                               num_free_kv_blocks=64, num_cached_kv_blocks=0, num_steps=3,
                               num_prompt_tokens=prompt, num_computed_prompt_tokens=prompt - cached,
                               num_cached_prompt_tokens=cached, num_generated_tokens=6,
                               num_preemptions=0))
        published.publish(m)
    sent = [(name, value) for name, _, value in pb.log if name.startswith("llm_prefix_cache_")
            and name.endswith("_total")]
    assert sent == [("llm_prefix_cache_queries_total", 100),
                    ("llm_prefix_cache_queries_total", 150), ("llm_prefix_cache_hits_total", 96)]



def test_preemptions_go_out_as_deltas_of_the_engines_count():
    pb = _FakePbUtils()
    published = TritonMetrics(pb, {"model": "llm", "version": "1"})
    m = ServingMetrics()
    for preemptions in (0, 3, 3, 7):
        m.on_stats(EngineStats(num_running=0, num_waiting=0, num_kv_blocks=64,
                               num_free_kv_blocks=64, num_cached_kv_blocks=0, num_steps=3,
                               num_prompt_tokens=10, num_computed_prompt_tokens=10,
                               num_cached_prompt_tokens=0, num_generated_tokens=6,
                               num_preemptions=preemptions))
        published.publish(m)
    assert [value for name, _, value in pb.log if name == "llm_num_preemptions_total"] == [3, 4]


def test_whole_requests_are_bucketed_up_to_hours():
    """llm_e2e_request_latency_seconds covers whole requests (vLLM's e2e buckets), not the
    first-token scale: a 45 s or 10-minute request lands in a finite bucket."""
    m = ServingMetrics()
    for seconds in (0.2, 45.0, 600.0):
        m.on_request_done(seconds)
    cumulative, total, n = m.e2e.snapshot()
    buckets = m.e2e.buckets
    assert n == 3 and total == pytest.approx(645.2) and buckets[-1] >= 7680
    assert cumulative[buckets.index(60.0)] == 2 and cumulative[buckets.index(960.0)] == 3


def test_a_first_token_minutes_late_is_bucketed():
    """A TTFT behind a long queue (a flood of long prompts) lands in a finite bucket, as in
    vLLM's (up to 2,560 s), where quantiles can read it; the sub-second scale is kept."""
    m = ServingMetrics()
    for seconds in (0.004, 45.0, 300.0):
        m.on_first_token(seconds)
    cumulative, _, n = m.ttft.snapshot()
    buckets = m.ttft.buckets
    assert n == 3 and buckets[:3] == (0.001, 0.0025, 0.005) and buckets[-1] >= 2560
    assert cumulative[buckets.index(0.005)] == 1
    assert cumulative[buckets.index(60.0)] == 2 and cumulative[buckets.index(640.0)] == 3


def test_two_gpus_instances_of_one_name_get_series_of_their_own():
    """Triton names the instance on each GPU llm_0_0: the device label keeps their series
    apart (the same labels would give both stubs one shared series)."""
    a = instance_labels("llm", "1", "llm_0_0", "cuda:0")
    b = instance_labels("llm", "1", "llm_0_0", "cuda:1")
    assert a != b and a["instance"] == b["instance"] == "llm_0_0"
    assert (a["device"], b["device"]) == ("cuda:0", "cuda:1")


def test_closed_metrics_publish_nothing_and_are_never_freed():
    """At llm's finalize: Triton's metric objects must never be freed (at the stub's exit they
    wrote to its freed shared memory; at finalize they deleted series a reload's instances
    share, and the server crashed), and nothing is published after."""
    import gc
    import weakref
    pb = _FakePbUtils()
    published = TritonMetrics(pb, {"model": "llm", "version": "1"})
    family = weakref.ref(published._families[0])
    m = ServingMetrics()
    m.on_tokens(10, 6)
    published.close()
    published.close()                  # once is enough; twice is harmless
    published.publish(m)
    assert pb.log == []
    del published
    gc.collect()
    assert family() is not None


def test_a_stopped_engines_stats_publish_zero_gauges():
    """ServingEngine publishes a stopped engine's stats with no pool (0 blocks): its gauges go
    to 0 (the usage ratio was 1 - 0/1 = 1, a full pool that no engine holds), its counters stay."""
    pb = _FakePbUtils()
    published = TritonMetrics(pb, {"model": "llm", "version": "1"})
    m = ServingMetrics()
    m.on_stats(EngineStats(num_running=0, num_waiting=0, num_kv_blocks=0, num_free_kv_blocks=0,
                           num_cached_kv_blocks=0, num_steps=3, num_prompt_tokens=10,
                           num_computed_prompt_tokens=4, num_cached_prompt_tokens=6,
                           num_generated_tokens=6, num_preemptions=0))
    published.publish(m)
    gauges = {name: value for name, _, value in pb.log if name in (
        "llm_kv_blocks_total", "llm_kv_blocks_free", "llm_kv_cache_usage_ratio",
        "llm_prefix_cache_hit_ratio", "llm_num_requests_running")}
    assert gauges == dict.fromkeys(gauges, 0) and len(gauges) == 5, gauges
    assert ("llm_engine_steps_total", None, 3) in pb.log


def test_the_routing_peers_gauge_is_set_at_every_publication():
    """A reload's new instances share the old ones' series (the same labels): the old ones,
    stopping, published 0 peers after the new ones had published theirs, and the new ones set
    the gauge only when their own value changed, so it read 0 for good while routing worked."""
    pb = _FakePbUtils()
    published = TritonMetrics(pb, {"model": "llm", "version": "1"})
    m = ServingMetrics()
    m.routing_peers = 1
    for _ in range(3):
        published.publish(m)
    assert [v for name, _, v in pb.log if name == "llm_prefix_routing_peers"] == [1, 1, 1]
