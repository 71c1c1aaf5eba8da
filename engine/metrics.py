"""Serving metrics: counted in the serving process, published to Triton's /metrics twice a second.

Every call into Triton's custom-metrics API (`pb_utils`) is a round trip to tritonserver,
handled on the one thread of the server that also passes on cancellation checks and logs for
this model instance. Nothing on a request's path may make one: the serving code records into
`ServingMetrics` (plain Python, any thread), and `TritonMetrics.publish` sends what changed
since its last call. Histograms go out in Prometheus' histogram layout, as three counter
families `NAME_bucket{le=...}`, `NAME_sum` and `NAME_count` (Triton's own histogram takes one
observation per call), so `histogram_quantile` works on them as on any histogram.

The Triton `pb_utils` module is passed in, not imported, so engine/ stays free of server code.
"""
from __future__ import annotations

import bisect
import ctypes
import threading

from engine.outputs import EngineStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0)
# A first token waits behind a queue that a flood of long prompts makes minutes long (vLLM's
# TTFT buckets reach 2,560 s): above 30 s it still lands in a finite bucket.
TTFT_BUCKETS = LATENCY_BUCKETS + (60.0, 120.0, 240.0, 640.0, 2560.0)
# Whole requests run from a fraction of a second to many minutes (vLLM's e2e buckets).
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# ServingMetrics' histograms: attribute -> (Prometheus name, description, bucket bounds).
HISTOGRAMS = {
    "ttft": ("llm_time_to_first_token_seconds", "Time from arrival to the first generated token",
             TTFT_BUCKETS),
    "itl": ("llm_inter_token_latency_seconds", "Time between generated tokens of a request, as sent",
            LATENCY_BUCKETS),
    "e2e": ("llm_e2e_request_latency_seconds",
            "Time from arrival until a request's final response (any finish reason)",
            REQUEST_BUCKETS),
    "send": ("llm_response_send_seconds", "Time to hand one response to tritonserver",
             LATENCY_BUCKETS),
    "loop_lag": ("llm_event_loop_lag_seconds",
                 "How late the serving event loop wakes from a 10 ms sleep", LAG_BUCKETS),
}
FINISH_REASONS = ("stop", "length", "abort")


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)      # per bucket, the last one +Inf
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value` (e.g. each token of a response, the response's
        gap shared out among them)."""
        i = bisect.bisect_left(self.buckets, value)
        with self._lock:
            self.counts[i] += count
            self.sum += value * count
            self.count += count

    def snapshot(self) -> tuple[list[int], float, int]:
        """Cumulative bucket counts (le order, +Inf last), sum, count."""
        with self._lock:
            counts, total, n = list(self.counts), self.sum, self.count
        cumulative, running = [], 0
        for c in counts:
            running += c
            cumulative.append(running)
        return cumulative, total, n


class ServingMetrics:
    """What the serving code records. Counters only grow; gauges hold the last value."""
    ttft: Histogram             # one attribute per HISTOGRAMS key
    itl: Histogram
    e2e: Histogram
    send: Histogram
    loop_lag: Histogram

    def __init__(self) -> None:
        for key, (_, _, buckets) in HISTOGRAMS.items():
            setattr(self, key, Histogram(buckets))
        self._lock = threading.Lock()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "responses": 0,
                         "response_tokens": 0, "run_on_peer": 0,
                         **{f"finished_{r}": 0 for r in FINISH_REASONS}}
        self.loop_lag_max = 0.0
        self.routing_peers = 0
        self.stats: EngineStats | None = None

    def _add(self, key: str, value: int) -> None:
        with self._lock:
            self.counters[key] += value

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_inter_token(self, seconds: float, count: int = 1) -> None:
        self.itl.observe(seconds, count)

    def on_request_done(self, seconds: float) -> None:
        self.e2e.observe(seconds)

    def on_response(self, num_tokens: int, send_seconds: float) -> None:
        with self._lock:
            self.counters["responses"] += 1
            self.counters["response_tokens"] += num_tokens
        self.send.observe(send_seconds)

    def on_tokens(self, num_prompt: int, num_generated: int) -> None:
        """A finished request's tokens. Its prompt counts only if it was prefilled (made a
        token), as vLLM counts prompt tokens: one aborted while it waited was never computed."""
        with self._lock:
            self.counters["prompt_tokens"] += num_prompt if num_generated else 0
            self.counters["generation_tokens"] += num_generated

    def on_finish(self, reason: str | None) -> None:
        if reason in FINISH_REASONS:
            self._add(f"finished_{reason}", 1)

    def on_run_on_peer(self) -> None:
        self._add("run_on_peer", 1)

    def on_loop_lag(self, seconds: float) -> None:
        self.loop_lag.observe(seconds)

    def on_loop_lag_max(self, seconds: float) -> None:
        self.loop_lag_max = seconds

    def on_routing_peers(self, count: int) -> None:
        self.routing_peers = count

    def on_stats(self, stats: EngineStats) -> None:
        self.stats = stats

    def snapshot_counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    def snapshot(self) -> tuple[dict[str, int], dict[str, tuple[list[int], float, int]]]:
        """(counters, histograms) as they stand: the counters read first. The serving code
        observes a request's latencies before it counts the request finished, so histograms
        read after the counters hold the latencies of every request the counters count."""
        counters = self.snapshot_counters()
        return counters, {key: getattr(self, key).snapshot() for key in HISTOGRAMS}


def instance_labels(model: str, version: str, instance: str, device: str) -> dict[str, str]:
    """The labels of one llm instance's series: Triton's instance name and the engine's device.

    Triton names instances per GPU: with `count: 1` on two GPUs both are `llm_0_0` (seen on the
    H200 pair). Two stubs asking for a metric of the same name and labels get one shared
    series, so without the device each gauge showed whichever engine wrote last and each
    counter the engines' sum. The pair (instance, device) names one engine."""
    return {"model": model, "version": version, "instance": instance, "device": device}


class TritonMetrics:
    """Publishes a ServingMetrics to Triton's /metrics (call `publish` from one thread)."""

    def __init__(self, pb_utils, labels: dict[str, str]) -> None:
        MF = pb_utils.MetricFamily
        self._families = []                 # a family must outlive its metrics

        def family(name, description, kind):
            self._families.append(MF(name=name, description=description, kind=kind))
            return self._families[-1]

        def counter(name, description, extra=None):
            return family(name, description, MF.COUNTER).Metric(labels={**labels, **(extra or {})})

        def gauge(name, description):
            return family(name, description, MF.GAUGE).Metric(labels=labels)

        def histogram(name, description, buckets):
            bucket = family(f"{name}_bucket", f"{description} (cumulative count per bucket)",
                            MF.COUNTER)
            les = [_le(b) for b in buckets] + ["+Inf"]
            return ([bucket.Metric(labels={**labels, "le": le}) for le in les],
                    counter(f"{name}_sum", f"{description} (sum)"),
                    counter(f"{name}_count", f"{description} (count)"))

        self._hist = {key: histogram(name, description, buckets)
                      for key, (name, description, buckets) in HISTOGRAMS.items()}
        finished = family("llm_requests_finished_total", "Finished requests by reason",
                          MF.COUNTER)
        self._counters = {
            "prompt_tokens": counter("llm_prompt_tokens_total",
                                     "Prompt tokens of finished requests that were prefilled "
                                     "(made a token)"),
            "generation_tokens": counter("llm_generation_tokens_total", "Generated tokens"),
            "responses": counter("llm_responses_total", "Responses sent (one may carry several "
                                 "tokens: a stream's tokens that piled up while it waited)"),
            "response_tokens": counter("llm_response_tokens_total",
                                       "Generated tokens carried by the responses sent"),
            "run_on_peer": counter("llm_requests_run_on_peer_total",
                                   "Requests this instance took and ran on another instance's "
                                   "engine, which held their prompt's prefix (prefix routing)"),
            **{f"finished_{r}": finished.Metric(labels={**labels, "reason": r})
               for r in FINISH_REASONS},
        }
        self._steps = counter("llm_engine_steps_total", "Engine steps (schedule, run, update)")
        self._graph_steps = counter("llm_engine_graph_steps_total",
                                    "Engine steps run as captured CUDA graphs, whole or cut "
                                    "at attention (the rest of llm_engine_steps_total were "
                                    "launched eagerly)")
        self._preemptions = counter("llm_num_preemptions_total",
                                    "Running requests preempted for want of KV blocks (their "
                                    "blocks freed, their tokens recomputed when resumed)")
        self._cascade_rows = counter("llm_cascade_rows_total",
                                     "Query rows whose shared prefix was read once per group "
                                     "(cascade attention)")
        # vLLM's prefix_cache_queries / prefix_cache_hits: rate(hits) / rate(queries) is the
        # hit ratio over any window, where the gauge below is since start.
        self._prefix_queries = counter("llm_prefix_cache_queries_total",
                                       "Prompt tokens of admitted requests, looked up in the "
                                       "prefix cache")
        self._prefix_hits = counter("llm_prefix_cache_hits_total",
                                    "Prompt tokens found in the prefix cache (not computed)")
        self._gauges = {
            "running": gauge("llm_num_requests_running", "Requests in the running batch"),
            "waiting": gauge("llm_num_requests_waiting", "Requests waiting to be scheduled"),
            "kv_total": gauge("llm_kv_blocks_total", "KV-cache blocks in the pool"),
            "kv_free": gauge("llm_kv_blocks_free", "KV-cache blocks free (cached or empty)"),
            "kv_usage": gauge("llm_kv_cache_usage_ratio", "Fraction of KV blocks in use"),
            "prefix_hit": gauge("llm_prefix_cache_hit_ratio",
                                "Prompt tokens served from the prefix cache / prompt tokens"),
            "routing_peers": gauge("llm_prefix_routing_peers",
                                   "Other instances' engines this instance is connected to "
                                   "(prefix routing)"),
            "loop_lag_max": gauge("llm_event_loop_lag_max_seconds",
                                  "Largest event-loop lag over the last half second"),
        }
        self._sent: dict[str, float] = {}   # what each counter showed at the last publish
        self._closed = False

    def publish(self, m: ServingMetrics, cut=None) -> None:
        """Sends what changed since the last call. cut: `m.snapshot()` taken before m.stats
        was fetched (the serving loop's order), else taken here. Published in the reverse of
        the order read: the engine's stats (fetched after the cut, so they count every step
        of every request the cut counts), then the histograms, then the counters. So a scrape
        that shows a request finished also shows its latencies and the engine steps that
        produced its tokens (scripts/server_probe.py's `server_side` relies on it)."""
        if self._closed:
            return
        counters, snapshots = cut if cut is not None else m.snapshot()
        self._gauges["loop_lag_max"].set(m.loop_lag_max)
        # Set at every publication, as the other gauges: a reload's instances share the old
        # ones' series, which publish their 0 as they stop.
        self._gauges["routing_peers"].set(m.routing_peers)
        stats = m.stats
        if stats is not None:
            g = self._gauges
            g["running"].set(stats.num_running)
            g["waiting"].set(stats.num_waiting)
            g["kv_total"].set(stats.num_kv_blocks)
            g["kv_free"].set(stats.num_free_kv_blocks)
            live = stats.num_kv_blocks > 0          # 0: the engine has stopped
            g["kv_usage"].set(1.0 - stats.num_free_kv_blocks / stats.num_kv_blocks if live else 0.0)
            g["prefix_hit"].set(stats.num_cached_prompt_tokens / max(stats.num_prompt_tokens, 1)
                                if live else 0.0)
            # After the gauges: a scrape that shows the step count moved shows gauges from
            # the same publication or a later one (tests/test_serving.py relies on it).
            self._increment("preemptions", self._preemptions, stats.num_preemptions)
            self._increment("cascade_rows", self._cascade_rows, stats.num_cascade_rows)
            # Queries before hits: a scrape between them never sees more hits than queries.
            self._increment("prefix_queries", self._prefix_queries, stats.num_prompt_tokens)
            self._increment("prefix_hits", self._prefix_hits, stats.num_cached_prompt_tokens)
            self._increment("graph_steps", self._graph_steps, stats.num_graph_steps)
            self._increment("steps", self._steps, stats.num_steps)
        for key, (buckets, sum_metric, count_metric) in self._hist.items():
            cumulative, total, n = snapshots[key]
            # Each increment is a round trip a scrape can fall between: from +Inf down (with
            # _count beside it), a scrape sees higher buckets new and lower ones old, so the
            # buckets stay cumulative (lowest first, one could stand above the next).
            inf = len(buckets) - 1
            self._increment(f"{key}:{inf}", buckets[inf], cumulative[inf])
            self._increment(f"{key}:count", count_metric, n)
            for i in range(inf - 1, -1, -1):
                self._increment(f"{key}:{i}", buckets[i], cumulative[i])
            self._increment(f"{key}:sum", sum_metric, total)
        for key, value in counters.items():
            self._increment(key, self._counters[key], value)

    def close(self) -> None:
        """Stops publishing, and keeps Triton's metric objects for the life of the process,
        their series as last published. They must never be freed: freed at the stub's exit
        (by its last collection: the engine's objects hold them in reference cycles), they
        wrote to its shared memory after it was gone (a segfault on every unload); freed at
        finalize, they deleted their series in the server, under the instances of a reload,
        which share them (same names and labels), and the server crashed (a heap corruption,
        SIGABRT). So this object's reference count is raised for good."""
        if not self._closed:
            self._closed = True
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self))

    def _increment(self, key: str, metric, value: float) -> None:
        delta = value - self._sent.get(key, 0)
        if delta > 0:
            metric.increment(delta)
            self._sent[key] = value


def _le(bound: float) -> str:
    return repr(float(bound))
