"""What a benchmark reads from a running tritonserver and from the machine under it.

- /metrics: histogram deltas between two scrapes (count, mean, quantiles interpolated within
  the bucket as Prometheus' histogram_quantile does, the highest non-empty bucket), gauges, and
  a thread that polls one gauge;
- CPU seconds of the machine, of this process and of each server process (the llm stub's
  threads one by one), and the kernel's CPU pressure (time some runnable task waited for a CPU);
- for scripts/bench_serving.py: CPU seconds by kind of process (server, stubs, engine core,
  load generators), the server-side figures of a run from two scrapes, a scrape once a run's
  finishes are published, and Triton's own queue time per model.
"""
from __future__ import annotations

import os
import platform
import re
import threading
import time
import urllib.request

import numpy as np

from scripts.bench_common import process_cmdlines


def scrape(metrics_url: str) -> dict[str, float]:
    """The `llm_*` series of /metrics: {'name{labels}': value}."""
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("llm_"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def _buckets(values: dict[str, float], name: str) -> list[tuple[float, float]]:
    """[(le, cumulative count)] ascending, +Inf last, summed over the other labels (each
    instance of the model publishes its own series)."""
    pat = re.compile(re.escape(name) + r'_bucket\{.*le="([^"]+)".*\}$')
    counts: dict[float, float] = {}
    for k, v in values.items():
        if m := pat.match(k):
            counts[float(m.group(1))] = counts.get(float(m.group(1)), 0.0) + v
    return sorted(counts.items())


def _sum(values: dict[str, float], name: str) -> float:
    return sum(v for k, v in values.items() if k.startswith(name + "{"))


def hist_delta(before: dict[str, float], after: dict[str, float], name: str) -> dict:
    """What histogram `name` (in seconds) observed between two scrapes, in ms, over all the
    model's instances. A quantile that falls in the +Inf bucket is reported as the last finite
    bound (a floor); `max_bucket_ms` is [lower, upper] of the highest non-empty bucket, upper
    None for +Inf."""
    start = dict(_buckets(before, name))
    cum = [(le, c - start.get(le, 0.0)) for le, c in _buckets(after, name)]
    total = cum[-1][1] if cum else 0.0
    total_s = _sum(after, name + "_sum") - _sum(before, name + "_sum")

    def quantile_ms(q: float) -> float | None:
        if total <= 0:
            return None
        rank, lo, prev = q * total, 0.0, 0.0
        for le, c in cum:
            if c >= rank:
                if le == float("inf"):
                    return 1e3 * lo
                return 1e3 * (lo + (le - lo) * (rank - prev) / max(c - prev, 1e-12))
            lo, prev = le, c
        return 1e3 * lo

    top, prev_le, prev = None, 0.0, 0.0
    for le, c in cum:
        if c > prev:
            top = [1e3 * prev_le, None if le == float("inf") else 1e3 * le]
        prev_le, prev = le, c
    return {"count": int(total), "mean_ms": 1e3 * total_s / total if total else None,
            "p50_ms": quantile_ms(0.50), "p99_ms": quantile_ms(0.99), "max_bucket_ms": top}


def gauge(values: dict[str, float], name: str) -> float:
    """The largest value of gauge `name` over its label sets (0 if absent)."""
    return max((v for k, v in values.items() if k.startswith(name + "{")), default=0.0)


def _label(key: str, label: str) -> str | None:
    """Label `label`'s value in a series key 'name{a="x",b="y"}' (None without it)."""
    m = re.search(r'[{,]%s="([^"]*)"' % re.escape(label), key)
    return m.group(1) if m else None


def per_instance(values: dict[str, float], name: str) -> dict[str, float]:
    """Series `name` by llm engine, summed over the other labels: keyed "instance@device"
    (engine/metrics.py instance_labels: on GPUs Triton gives each GPU's instance one name),
    or by instance alone where a series has no device label."""
    out: dict[str, float] = {}
    for key, v in values.items():
        if key.startswith(name + "{") and (instance := _label(key, "instance")) is not None:
            device = _label(key, "device")
            engine = instance if device is None else f"{instance}@{device}"
            out[engine] = out.get(engine, 0.0) + v
    return out


def engine_loads(values: dict[str, float]) -> dict[str, float]:
    """Each llm instance's engine: the requests it runs or has waiting (those another
    instance routed to it included: prefix routing), as last published."""
    running = per_instance(values, "llm_num_requests_running")
    waiting = per_instance(values, "llm_num_requests_waiting")
    return {k: running[k] + waiting.get(k, 0.0) for k in sorted(running)}


class GaugePoller(threading.Thread):
    """Reads gauge `name` every `interval_s`; `samples`: [(perf_counter time, value)]. A
    subclass may read something else from the scrape (`read`; its `name` is then None)."""

    clock = staticmethod(time.perf_counter)     # the samples' times

    def __init__(self, metrics_url: str, name: str | None, interval_s: float) -> None:
        super().__init__(name="gauge-poller", daemon=True)
        self.metrics_url, self.gauge_name, self.interval_s = metrics_url, name, interval_s
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval_s):
            try:
                value = self.read(scrape(self.metrics_url))
            except OSError:             # a scrape that timed out: the next one will do
                continue
            self.samples.append((self.clock(), value))

    def read(self, values: dict[str, float]):
        return gauge(values, self.gauge_name)

    def max_between(self, start: float, end: float) -> float | None:
        values = [v for t, v in self.samples if start <= t <= end]
        return max(values) if values else None


class LoadPoller(GaugePoller):
    """Every llm engine's load (engine_loads) every `interval_s`: how far apart the engines of
    several instances run (prefix routing keeps a group on one engine while the loads stay
    within its slack). Its samples carry wall-clock times, as the clients' sends do."""

    clock = staticmethod(time.time)

    def __init__(self, metrics_url: str, interval_s: float = 0.5) -> None:
        super().__init__(metrics_url, None, interval_s)

    def read(self, values: dict[str, float]) -> dict[str, float]:
        return engine_loads(values)

    def summary(self, window: tuple[float, float] | None = None) -> dict:
        """Each engine's mean load and, with two or more, the gap between the most and the
        least loaded (p50 / p90 over the samples): {} before the first sample. With a window
        (the clients' full load: serving_clients.full_load_window), over the samples in it:
        those before the clients start and after they stop count idle engines, and put the
        mean load well under the requests in flight (benchmarks/h200x2/
        served_shared_prefix.md, fifty-first session)."""
        loads = [v for t, v in self.samples
                 if v and (window is None or window[0] <= t <= window[1])]
        if not loads:                       # no window, or none of the samples in it
            loads = [v for _, v in self.samples if v]
        if not loads:
            return {}
        names = sorted(loads[-1])
        out = {"engine_loads_mean": {k: round(sum(s.get(k, 0.0) for s in loads) / len(loads), 1)
                                     for k in names}}
        if len(names) > 1:
            # np.percentile's rule, as the clients' figures (one rank rule for both: the
            # upper middle for p50 and the lower rank for p90 could put p90 below p50)
            gaps = [max(s.values()) - min(s.values()) for s in loads]
            out["engine_load_gap_p50"] = round(float(np.percentile(gaps, 50)), 3)
            out["engine_load_gap_p90"] = round(float(np.percentile(gaps, 90)), 3)
        return out


# ---------------------------------------------------------------------------- CPU
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_seconds(server_pids: list[int]) -> dict[str, float]:
    """CPU seconds so far: the machine (busy and total, all cores), this process ("client"),
    each server process by role, each thread of the llm stub ("thread:TID"), and the CPU
    pressure stall time ("cpu_pressure_some")."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    out = {"machine_busy": (sum(fields) - fields[3] - fields[4]) / tick,   # - idle - iowait
           "machine_total": sum(fields) / tick, "client": sum(os.times()[:2])}
    for pid in server_pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:                 # exited meanwhile
            continue
        role = _role(cmd, pid)
        out[role] = _cpu_s(stat, tick)
        if role.startswith("stub_llm["):
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        out[f"thread:{tid}"] = _cpu_s(f.read(), tick)
                except OSError:
                    continue
    try:
        with open("/proc/pressure/cpu") as f:
            out["cpu_pressure_some"] = int(f.readline().split("total=")[1]) / 1e6
    except (OSError, IndexError, ValueError):   # no PSI in this kernel
        pass
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float], seconds: float) -> dict:
    """Cores used on average between two `cpu_seconds`; `cpu_pressure_some` becomes the
    fraction of the time some runnable task waited for a CPU; `other_processes` is machine
    busy minus the server and this client (load that is not ours); the llm stub's four
    busiest threads as [tid, cores]."""
    def rate(k: str) -> float:
        return round((after[k] - before.get(k, 0.0)) / seconds, 3)

    out = {k: rate(k) for k in after if k != "machine_total" and not k.startswith("thread:")}
    threads = sorted(((rate(k), k[7:]) for k in after if k.startswith("thread:")), reverse=True)
    ours = sum(v for k, v in out.items()
               if k in ("client", "tritonserver") or k.startswith(("stub_", "engine_core")))
    out["other_processes"] = round(out["machine_busy"] - ours, 3)
    out["machine_busy_fraction"] = round(
        (after["machine_busy"] - before["machine_busy"])
        / max(after["machine_total"] - before["machine_total"], 1e-9), 3)
    out["stub_llm_top_threads"] = [[tid, cores] for cores, tid in threads[:4]]
    return out


def _cpu_s(stat: str, tick: int) -> float:
    utime, stime = (int(x) for x in stat[stat.rindex(")") + 2:].split()[11:13])
    return (utime + stime) / tick


def _role(cmd: str, pid: int) -> str:
    if "engine.core_process" in cmd:
        return f"engine_core[{pid}]"
    if "triton_python_backend_stub" in cmd:
        return f"stub_{'llm_bls' if '/llm_bls/' in cmd else 'llm'}[{pid}]"
    if "tritonserver" in cmd:
        return "tritonserver"
    return f"{os.path.basename(cmd.split(' ')[0])}[{pid}]"


# ---------------------------------------------------------------------------- bench_serving's
def cpu_times() -> dict[str, float]:
    """CPU seconds used so far by each kind of process on this machine (Linux /proc): the
    server, its stubs, the engine's core and tokenizer processes, the load generators. (Summed
    by kind over every process, for bench_serving's tables; cpu_seconds above keeps one entry
    per server process and stub thread, for bench_loop_lag's.)"""
    tick = os.sysconf("SC_CLK_TCK")
    kinds = {"engine.core_process": "engine core", "engine.tokenizer_process": "tokenizer",
             "triton_python_backend_stub": "python stubs", "tritonserver": "tritonserver",
             "perf_analyzer": "perf_analyzer", "--py-client-worker": "python clients",
             "--direct-worker": "direct engine"}
    out: dict[str, float] = {}
    for pid, cmd in process_cmdlines():
        kind = next((v for k, v in kinds.items() if k in cmd), None)
        if not kind:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                seconds = _cpu_s(f.read(), tick)
        except OSError:
            continue
        out[kind] = out.get(kind, 0.0) + seconds
    return out


def cpu_use(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Cores busy on average per kind of process between two cpu_times(), for every kind
    running at the second (0.0 for one that ran less than a clock tick in a short run)."""
    if seconds <= 0:
        return {}
    return {k: round(max(after[k] - before.get(k, 0.0), 0.0) / seconds, 2) for k in sorted(after)}


def children_cpu() -> float:
    """CPU seconds of this process's finished children (the load generators, once waited)."""
    t = os.times()
    return t.children_user + t.children_system


def server_side(before: dict, after: dict) -> dict:
    """What the server's metrics say of a run between two scrapes: its TTFT, ITL and loop lag
    histograms, the share of steps run as CUDA graphs, the tokens per response, the prefix
    cache's share, the requests prefix routing ran on another instance's engine."""
    out = {}
    for name, key in (("llm_time_to_first_token_seconds", "server_ttft"),
                      ("llm_inter_token_latency_seconds", "server_itl"),
                      ("llm_event_loop_lag_seconds", "loop_lag")):
        h = hist_delta(before, after, name)
        out[key] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in h.items()
                    if k in ("count", "p50_ms", "p99_ms", "mean_ms")}

    def delta(name):
        return _sum(after, name) - _sum(before, name)
    steps = delta("llm_engine_steps_total")
    if steps:       # the rest ran eagerly: prompt chunks in the step (or no graph, or CPU)
        out["graph_step_fraction"] = round(delta("llm_engine_graph_steps_total") / steps, 3)
    responses, tokens = delta("llm_responses_total"), delta("llm_response_tokens_total")
    if responses:
        out["server_tokens_per_response"] = round(tokens / responses, 2)
    # Shared prefixes: query rows that read theirs once per group (cascade attention), the
    # prefix cache's hits over the run's prompt tokens (counters), and since the server
    # started (a gauge).
    out["cascade_rows"] = int(delta("llm_cascade_rows_total"))
    # Prefix routing: the requests an instance ran on another instance's engine.
    out["requests_run_on_peer"] = int(delta("llm_requests_run_on_peer_total"))
    queries = delta("llm_prefix_cache_queries_total")
    if queries:
        out["prefix_cache_hit_ratio"] = round(delta("llm_prefix_cache_hits_total") / queries, 3)
    ratios = [v for k, v in after.items() if k.startswith("llm_prefix_cache_hit_ratio{")]
    if ratios:                  # one per llm instance: their mean
        out["prefix_cache_hit_ratio_since_start"] = round(sum(ratios) / len(ratios), 3)
    return out


def scrape_published(metrics_url: str, before: dict, requests: int,
                     timeout_s: float = 30.0) -> dict:
    """The server's metrics once they include a run's `requests` finished requests (the model
    publishes them twice a second, so a scrape right after the last answer can miss some)."""
    def finished(m):
        return sum(v for k, v in m.items() if k.startswith("llm_requests_finished_total{"))
    deadline = time.monotonic() + timeout_s
    while True:
        after = scrape(metrics_url)
        if finished(after) - finished(before) >= requests or time.monotonic() > deadline:
            return after
        time.sleep(0.1)     # polling the published state, not standing in for it


def triton_queue_us(metrics_url: str) -> dict[str, float]:
    """Triton's own cumulative queue time and request count per model."""
    with urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        for name in ("nv_inference_queue_duration_us", "nv_inference_request_success"):
            if line.startswith(name + "{"):
                model = line.split('model="', 1)[1].split('"', 1)[0]
                out[f"{name}:{model}"] = out.get(f"{name}:{model}", 0.0) + float(line.rsplit(" ", 1)[1])
    return out
