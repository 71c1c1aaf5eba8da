"""Serving metrics through Triton's custom-metrics API (shown on the server's /metrics).

The Triton `pb_utils` module is passed in, not imported, so engine/ stays free of server code.
"""
from __future__ import annotations

from engine.outputs import EngineStats

_LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0]
_LAG_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]


class TritonMetrics:
    def __init__(self, pb_utils, labels: dict[str, str]) -> None:
        MF = pb_utils.MetricFamily
        # A family must outlive its metrics, so we hold on to every one.
        self._families = []

        def family(name, description, kind):
            self._families.append(MF(name=name, description=description, kind=kind))
            return self._families[-1]

        def histogram(name, description):
            return family(name, description, MF.HISTOGRAM).Metric(
                labels=labels, buckets=_LATENCY_BUCKETS)

        def metric(name, description, kind):
            return family(name, description, kind).Metric(labels=labels)

        self.ttft = histogram("llm_time_to_first_token_seconds",
                              "Time from arrival to the first generated token")
        self.itl = histogram("llm_inter_token_latency_seconds",
                             "Time between generated tokens of a request")
        self.prompt_tokens = metric("llm_prompt_tokens_total", "Prompt tokens of finished "
                                    "requests", MF.COUNTER)
        self.generation_tokens = metric("llm_generation_tokens_total", "Generated tokens",
                                        MF.COUNTER)
        finished = family("llm_requests_finished_total", "Finished requests by reason",
                          MF.COUNTER)
        self.finished = {r: finished.Metric(labels={**labels, "reason": r})
                         for r in ("stop", "length", "abort")}
        self.running = metric("llm_num_requests_running", "Requests in the running batch",
                              MF.GAUGE)
        self.waiting = metric("llm_num_requests_waiting", "Requests waiting to be scheduled",
                              MF.GAUGE)
        self.kv_total = metric("llm_kv_blocks_total", "KV-cache blocks in the pool", MF.GAUGE)
        self.kv_free = metric("llm_kv_blocks_free", "KV-cache blocks free (cached or empty)",
                              MF.GAUGE)
        self.kv_usage = metric("llm_kv_cache_usage_ratio", "Fraction of KV blocks in use",
                               MF.GAUGE)
        self.loop_lag = family("llm_event_loop_lag_seconds",
                               "How late the serving event loop wakes from a 10 ms sleep",
                               MF.HISTOGRAM).Metric(labels=labels, buckets=_LAG_BUCKETS)
        self.loop_lag_max = metric("llm_event_loop_lag_max_seconds",
                                   "Largest event-loop lag over the last half second", MF.GAUGE)
        self.prefix_hit = metric("llm_prefix_cache_hit_ratio",
                                 "Prompt tokens served from the prefix cache / prompt tokens",
                                 MF.GAUGE)
        # One step runs every scheduled request once: requests served together share steps.
        self.steps = metric("llm_engine_steps_total", "Engine steps (schedule, run, update)",
                            MF.COUNTER)
        self._num_steps = 0                 # the engine's count at the last publication

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_tokens(self, num_prompt: int, num_generated: int) -> None:
        self.prompt_tokens.increment(num_prompt)
        self.generation_tokens.increment(num_generated)

    def on_finish(self, reason: str) -> None:
        if reason in self.finished:
            self.finished[reason].increment(1)

    def on_loop_lag(self, seconds: float) -> None:
        self.loop_lag.observe(seconds)

    def on_loop_lag_max(self, seconds: float) -> None:
        self.loop_lag_max.set(seconds)

    def on_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_total.set(stats.num_kv_blocks)
        self.kv_free.set(stats.num_free_kv_blocks)
        self.kv_usage.set(1.0 - stats.num_free_kv_blocks / max(stats.num_kv_blocks, 1))
        self.prefix_hit.set(stats.num_cached_prompt_tokens / max(stats.num_prompt_tokens, 1))
        if stats.num_steps > self._num_steps:
            self.steps.increment(stats.num_steps - self._num_steps)
            self._num_steps = stats.num_steps
