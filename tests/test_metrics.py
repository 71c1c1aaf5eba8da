"""engine/metrics.py's publication order, with a stand-in for Triton's metrics API that logs
each increment (the real one is exercised through tritonserver in tests/test_serving.py)."""
from engine.metrics import ServingMetrics, TritonMetrics


class _FakePbUtils:
    """MetricFamily / Metric as pb_utils has them; every increment and set is logged."""

    def __init__(self):
        log = self.log = []

        class Metric:
            def __init__(self, family, labels):
                self.name, self.labels = family.name, labels

            def increment(self, value):
                log.append((self.name, self.labels.get("reason"), value))

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
    m.on_tokens(10, 6)
    m.on_finish("length")           # then counts the request finished
    published.publish(m)
    names = [name for name, _, _ in pb.log]
    finished = names.index("llm_requests_finished_total")
    for family in ("llm_time_to_first_token_seconds_count",
                   "llm_inter_token_latency_seconds_count",
                   "llm_time_to_first_token_seconds_bucket"):
        assert names.index(family) < finished, family
    assert ("llm_requests_finished_total", "length", 1) in pb.log
    pb.log.clear()
    published.publish(m)            # nothing changed: nothing sent again
    assert [e for e in pb.log if e[0] != "llm_event_loop_lag_max_seconds"] == []
