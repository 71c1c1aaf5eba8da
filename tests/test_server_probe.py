"""scripts/server_probe.py: histogram deltas and CPU accounting, on hand-made inputs."""
import time

import numpy as np
import pytest

from scripts.server_probe import (LoadPoller, cpu_delta, cpu_use, engine_loads, gauge,
                                  hist_delta, per_instance, server_side)
from scripts.serving_clients import full_load, full_load_window

LAG = "llm_event_loop_lag_seconds"


def hist(counts_by_le, total_s, labels='model="llm",version="1"'):
    """A scrape holding one histogram: {le: cumulative count}."""
    values = {f'{LAG}_bucket{{{labels},le="{le}"}}': float(c) for le, c in counts_by_le.items()}
    values[f"{LAG}_count{{{labels}}}"] = float(max(counts_by_le.values()))
    values[f"{LAG}_sum{{{labels}}}"] = total_s
    return values


def test_hist_delta_interpolates_within_the_bucket_of_the_delta():
    before = hist({"0.001": 50, "0.01": 50, "0.1": 50, "+Inf": 50}, 0.02)
    # Between the scrapes: 90 samples <= 1 ms, 10 in (10 ms, 100 ms].
    after = hist({"0.001": 140, "0.01": 140, "0.1": 150, "+Inf": 150}, 0.02 + 0.5)
    d = hist_delta(before, after, LAG)
    assert d["count"] == 100
    assert d["mean_ms"] == pytest.approx(5.0)
    assert d["p50_ms"] == pytest.approx(1.0 * 50 / 90)          # within (0, 1 ms]
    assert d["p99_ms"] == pytest.approx(10 + 90 * 9 / 10)        # 9th of 10 in (10, 100]
    assert d["max_bucket_ms"] == [10.0, 100.0]


def test_hist_delta_beyond_the_last_bound_is_a_floor_and_empty_is_none():
    before = hist({"0.5": 0, "5.0": 0, "+Inf": 0}, 0.0)
    after = hist({"0.5": 1, "5.0": 1, "+Inf": 3}, 20.0)
    d = hist_delta(before, after, LAG)
    assert d["p99_ms"] == 5000.0 and d["max_bucket_ms"] == [5000.0, None]
    empty = hist_delta(after, after, LAG)
    assert empty["count"] == 0 and empty["p99_ms"] is None and empty["max_bucket_ms"] is None


def test_hist_delta_sums_the_instances_series():
    """Each instance of the model publishes its own series (label `instance`)."""
    a = 'model="llm",version="1",instance="llm_0_0"'
    b = 'model="llm",version="1",instance="llm_0_1"'
    before = {**hist({"0.001": 0, "0.01": 0, "+Inf": 0}, 0.0, a),
              **hist({"0.001": 0, "0.01": 0, "+Inf": 0}, 0.0, b)}
    after = {**hist({"0.001": 10, "0.01": 10, "+Inf": 10}, 0.005, a),      # 10 x 0.5 ms
             **hist({"0.001": 0, "0.01": 30, "+Inf": 30}, 0.15, b)}        # 30 x 5 ms
    d = hist_delta(before, after, LAG)
    assert d["count"] == 40
    assert d["mean_ms"] == pytest.approx(1e3 * 0.155 / 40)
    assert d["p50_ms"] == pytest.approx(1 + 9 * 10 / 30)        # 20th of 40: 10th in (1, 10]
    assert d["max_bucket_ms"] == [1.0, 10.0]


def test_gauge_takes_the_largest_label_set():
    values = {'llm_event_loop_lag_max_seconds{model="a"}': 0.2,
              'llm_event_loop_lag_max_seconds{model="b"}': 0.7}
    assert gauge(values, "llm_event_loop_lag_max_seconds") == 0.7
    assert gauge({}, "llm_event_loop_lag_max_seconds") == 0.0


def _loads(running, waiting):
    """A scrape of two llm instances' engines: requests running and waiting on each."""
    values = {}
    for i, (r, w) in enumerate(zip(running, waiting)):
        labels = f'model="llm",version="1",instance="llm_0_0",device="cuda:{i}"'
        values[f"llm_num_requests_running{{{labels}}}"] = float(r)
        values[f"llm_num_requests_waiting{{{labels}}}"] = float(w)
    values['llm_kv_blocks_free{model="llm",version="1",instance="llm_0_0",device="cuda:0"}'] = 99.0
    return values


def test_engines_are_told_apart_by_instance_and_device():
    """On GPUs Triton names each GPU's instance alike (llm_0_0): the device label tells their
    engines apart; CPU instances differ by name; a series without a device keys by name."""
    m = 'model="llm",version="1"'
    values = {f'llm_kv_blocks_total{{{m},instance="llm_0_0",device="cuda:0"}}': 5,
              f'llm_kv_blocks_total{{device="cuda:1",instance="llm_0_0",{m}}}': 7,
              f'llm_kv_blocks_total{{{m},instance="llm_0_1",device="cpu"}}': 9,
              f'llm_kv_blocks_total{{{m},instance="llm_1_0"}}': 11,
              f'llm_kv_blocks_free{{{m},instance="llm_0_0",device="cuda:0"}}': 1}
    assert per_instance(values, "llm_kv_blocks_total") == {
        "llm_0_0@cuda:0": 5, "llm_0_0@cuda:1": 7, "llm_0_1@cpu": 9, "llm_1_0": 11}


def test_engine_loads_per_instance_and_the_gap_between_them():
    """Each engine's requests (running + waiting) by instance; the poller's summary gives each
    one's mean and the gap between the busiest and the idlest, p50 / p90 over its samples."""
    assert engine_loads(_loads([250, 262], [0, 6])) == {"llm_0_0@cuda:0": 250.0,
                                                        "llm_0_0@cuda:1": 268.0}
    poller = LoadPoller("unused:0")                 # not started: samples given by hand
    assert poller.summary() == {}
    gaps = [0, 4, 10, 20, 30, 40, 50, 60, 70, 100]
    poller.samples = [(float(t), engine_loads(_loads([256 + g, 256], [0, 0])))
                      for t, g in enumerate(gaps)] + [(10.0, {})]     # a scrape of no llm
    s = poller.summary()
    assert s["engine_loads_mean"] == {"llm_0_0@cuda:0": 256 + sum(gaps) / 10,
                                      "llm_0_0@cuda:1": 256.0}
    assert (s["engine_load_gap_p50"], s["engine_load_gap_p90"]) == (35.0, 73.0)   # np.percentile
    two = LoadPoller("unused:0")         # p50 took the upper middle, p90 the lower rank: 10 / 1
    two.samples = [(0.0, engine_loads(_loads([257, 256], [0, 0]))),
                   (1.0, engine_loads(_loads([266, 256], [0, 0])))]
    assert (two.summary()["engine_load_gap_p50"], two.summary()["engine_load_gap_p90"]) == (5.5, 9.1)
    one = LoadPoller("unused:0")                    # one instance: no gap to speak of
    one.samples = [(0.0, {"llm_0_0": 3.0})]
    assert one.summary() == {"engine_loads_mean": {"llm_0_0": 3.0}}


def test_engine_loads_over_the_clients_full_load_only():
    """Given the clients' full-load window (wall-clock seconds, as the sends), the samples
    before and after it, idle engines while the clients start and stop, do not count."""
    idle, busy = engine_loads(_loads([0, 0], [0, 0])), engine_loads(_loads([250, 240], [2, 0]))
    poller = LoadPoller("unused:0")
    assert poller.clock is time.time                # the clients' clock, not perf_counter
    poller.samples = ([(100.0 + t, idle) for t in range(3)] + [(103.0 + t, busy) for t in range(6)]
                      + [(109.0 + t, idle) for t in range(3)])
    assert poller.summary()["engine_loads_mean"] == {"llm_0_0@cuda:0": 126.0,
                                                     "llm_0_0@cuda:1": 120.0}
    s = poller.summary((103.0, 108.5))
    assert s["engine_loads_mean"] == {"llm_0_0@cuda:0": 252.0, "llm_0_0@cuda:1": 240.0}
    assert s["engine_load_gap_p50"] == 12.0
    assert poller.summary((200.0, 201.0)) == poller.summary()   # no sample in it: all of them


def test_the_full_load_window_runs_from_the_cth_send_to_the_last():
    assert full_load_window([5.0, 1.0, 2.0, 9.0, 3.0], 3) == (3.0, 9.0)
    assert full_load_window([1.0, 2.0], 2) is None          # no send after every slot filled


def test_the_full_load_window_waits_for_a_late_clients_slots():
    """c = 4 as two load generators of 2 slots, the second starting 1 s after the first, each a
    closed loop of ten 0.2 s requests a slot. The window opened at the 4th send overall (0.2 s,
    the early client's re-sends) while the late one's slots were empty, and closed at the
    late one's last send, 1 s after the early one's slots had emptied: 2.8 in flight "at full
    load". Now it runs from 1.0 (all four slots filled) to 1.8 (the early client's last send)."""
    starts = [t0 + 0.2 * k for t0 in (0.0, 0.0, 1.0, 1.0) for k in range(10)]
    index = [0] * 20 + [1] * 20
    assert full_load_window(starts, 4) == (0.2, 2.8)
    assert full_load_window(starts, 4, (index, [2, 2])) == (1.0, 1.8)
    s = np.array(starts)
    r = full_load(s, s + 0.02, s + 0.2, 10, 4, (index, [2, 2]))
    assert r["full_load_in_flight"] == 4.0 and r["full_load_s"] == 0.8
    assert full_load(s, s + 0.02, s + 0.2, 10, 4)["full_load_in_flight"] == 2.8
    # A client that never filled its slots: no full load at all.
    assert full_load_window(starts[:21], 4, (index[:21], [2, 2])) is None


def test_server_side_counts_a_runs_cascade_rows_and_prefix_hits():
    """Cascade rows between the scrapes, summed over the instances; the run's prefix-cache hit
    ratio from the counters' deltas over all instances; the gauge since start as the
    instances' mean."""
    a, b = 'model="llm",version="1",instance="llm_0_0"', 'model="llm",version="1",instance="llm_0_1"'
    before = {f"llm_cascade_rows_total{{{a}}}": 100.0, f"llm_cascade_rows_total{{{b}}}": 5.0,
              f"llm_prefix_cache_queries_total{{{a}}}": 1000.0,
              f"llm_prefix_cache_hits_total{{{a}}}": 0.0}
    after = {f"llm_cascade_rows_total{{{a}}}": 400.0, f"llm_cascade_rows_total{{{b}}}": 25.0,
             f"llm_prefix_cache_queries_total{{{a}}}": 3000.0,
             f"llm_prefix_cache_queries_total{{{b}}}": 2000.0,
             f"llm_prefix_cache_hits_total{{{a}}}": 1500.0,
             f"llm_prefix_cache_hits_total{{{b}}}": 1500.0,
             f"llm_prefix_cache_hit_ratio{{{a}}}": 0.8, f"llm_prefix_cache_hit_ratio{{{b}}}": 0.6}
    out = server_side(before, after)
    assert out["cascade_rows"] == 320
    assert out["prefix_cache_hit_ratio"] == pytest.approx(3000 / 4000)
    assert out["prefix_cache_hit_ratio_since_start"] == pytest.approx(0.7)
    none = server_side(after, after)
    assert none["cascade_rows"] == 0 and "prefix_cache_hit_ratio" not in none


def test_cpu_delta_cores_other_load_and_busiest_threads():
    before = {"machine_busy": 100.0, "machine_total": 200.0, "client": 1.0,
              "tritonserver": 2.0, "stub_llm[7]": 3.0, "engine_core[9]": 4.0,
              "thread:8": 1.0, "thread:10": 1.0, "cpu_pressure_some": 5.0}
    after = {"machine_busy": 118.0, "machine_total": 220.0, "client": 2.0,
             "tritonserver": 3.0, "stub_llm[7]": 9.0, "engine_core[9]": 10.0,
             "thread:8": 6.0, "thread:10": 1.5, "cpu_pressure_some": 11.0}
    d = cpu_delta(before, after, 10.0)
    assert d["machine_busy"] == 1.8 and d["machine_busy_fraction"] == 0.9
    assert d["stub_llm[7]"] == 0.6 and d["engine_core[9]"] == 0.6
    assert d["other_processes"] == pytest.approx(1.8 - (0.1 + 0.1 + 0.6 + 0.6))
    assert d["cpu_pressure_some"] == 0.6
    assert d["stub_llm_top_threads"] == [["8", 0.5], ["10", 0.05]]


def test_cpu_use_keeps_every_kind_running_even_one_idle_in_a_short_run():
    before = {"tritonserver": 1.0, "engine core": 2.0}
    after = {"tritonserver": 1.0, "engine core": 2.5, "tokenizer": 0.1}
    assert cpu_use(before, after, 0.5) == {"engine core": 1.0, "tokenizer": 0.2, "tritonserver": 0.0}
    assert cpu_use(before, after, 0.0) == {}
