"""engine/step_timing.py: the engine core's account of where its steps' time goes."""
import time

import pytest

from engine import LLM, SamplingParams
from engine.step_timing import PHASES, StepTimes
from scripts.make_tiny_model import make_tiny_model


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_phases_add_up_to_the_steps_wall_time(tmp_path, async_scheduling):
    llm = LLM(str(make_tiny_model(tmp_path / "m", arch="llama", seed=3)), dtype="float32",
              device="cpu", num_kv_blocks=64, max_num_batched_tokens=32,
              async_scheduling=async_scheduling)
    core = llm.core
    before = core.times.copy()
    core.add_request(core.make_request("t", list(range(5, 75)), SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True)))
    wall, steps = 0.0, 0
    while core.has_unfinished_requests():
        t0 = time.perf_counter()
        core.step()
        wall += time.perf_counter() - t0
        steps += 1
    t = core.times.since(before)
    assert t.steps == 3 + 5                        # 70 prompt tokens in chunks of 32, 5 decodes
    # Async: the last call runs nothing, it collects the last step's token.
    assert steps == t.steps + async_scheduling
    assert t.graph_steps == 0 and t.gpu == 0.0     # CPU: no graphs, no GPU timing
    phases = sum(getattr(t, p) for p in PHASES)
    assert all(getattr(t, p) > 0 for p in PHASES), t
    assert phases <= wall                          # disjoint parts of the steps' wall time
    ms = t.per_step_ms()
    assert set(ms) == {*PHASES, "wall", "graph_step_share", "piecewise_step_share"}
    assert t.piecewise_steps == 0 and ms["piecewise_step_share"] == 0.0


def test_since_and_per_step_ms_with_gpu_time():
    a = StepTimes(steps=2, graph_steps=1, schedule=0.002, launch=0.010, wait=0.004, gpu=0.012,
                  graph_gpu=0.004, gpu_events=True)
    b = StepTimes(steps=7, graph_steps=5, schedule=0.007, launch=0.035, wait=0.014, gpu=0.047,
                  graph_gpu=0.024, gpu_events=True)
    ms = b.since(a).per_step_ms()
    assert ms["schedule"] == 1.0 and ms["launch"] == 5.0 and ms["wait"] == 2.0
    assert ms["gpu"] == 7.0 and ms["wall"] == 8.0 and ms["graph_step_share"] == 0.8
    assert b.since(a).wall_s() == pytest.approx(0.040)     # 5 steps of 8 ms, the GPU's not added
    # 4 graph steps took 20 ms of the GPU's 35; the one eager step took the other 15.
    assert ms["gpu_graph_step"] == 5.0 and ms["gpu_other_step"] == 15.0
    assert "gpu_piecewise_step" not in ms and ms["piecewise_step_share"] == 0.0


def test_steps_cut_at_attention_are_graph_steps_timed_apart():
    """Steps with prompt chunks replayed as graphs cut at attention count among the graph
    steps (the served metric) and have a GPU time of their own, apart from decode graphs'."""
    a = StepTimes(gpu_events=True)
    b = StepTimes(steps=10, graph_steps=8, piecewise_steps=3, schedule=0.01, gpu=0.150,
                  graph_gpu=0.110, piecewise_gpu=0.090, gpu_events=True)
    ms = b.since(a).per_step_ms()
    assert ms["graph_step_share"] == 0.8 and ms["piecewise_step_share"] == 0.3
    # 5 decode graph steps: 20 ms of GPU; 3 cut ones: 90 ms; 2 eager: the other 40 ms.
    assert ms["gpu_graph_step"] == 4.0 and ms["gpu_piecewise_step"] == 30.0
    assert ms["gpu_other_step"] == 20.0


class _FakeEvent:
    """A CUDA event's timing side: recorded at `t` ms."""

    def __init__(self, t: float):
        self.t = t

    def elapsed_time(self, other: "_FakeEvent") -> float:
        return other.t - self.t


def test_gpu_time_of_a_step_launched_while_the_one_before_ran():
    """Async scheduling: step N+1 is queued before step N ends. Its GPU time runs from N's end
    (not from when it was queued) to its own end; a step queued after the one before ended
    counts from its own start. Times come from the step before's start event."""
    from types import SimpleNamespace
    from engine.model_runner import ModelRunner
    gpu_time = ModelRunner._gpu_time
    first = SimpleNamespace(events=(_FakeEvent(100.0), _FakeEvent(110.0)), prev_events=None)
    assert gpu_time(first) == pytest.approx(0.010)
    queued_early = SimpleNamespace(events=(_FakeEvent(104.0), _FakeEvent(121.0)),
                                   prev_events=first.events)
    assert gpu_time(queued_early) == pytest.approx(0.011)      # 110 -> 121
    queued_late = SimpleNamespace(events=(_FakeEvent(125.0), _FakeEvent(133.0)),
                                  prev_events=queued_early.events)
    assert gpu_time(queued_late) == pytest.approx(0.008)       # 125 -> 133


def test_graph_steps_are_counted_once_from_the_runners_report(tmp_path):
    """A step that ran as CUDA graphs says so in its ModelRunnerOutput; the core counts it in
    its StepTimes, and EngineStats (the served metrics) reads that count. (On CPU no step is
    a graph: the runner's report is made to say decode steps were.)"""
    llm = LLM(str(make_tiny_model(tmp_path / "m", arch="llama", seed=3)), dtype="float32",
              device="cpu", num_kv_blocks=64)
    core = llm.core
    collect = core.runner.collect

    def decode_steps_as_graphs(handle):
        out = collect(handle)
        out.graph = int(handle.x.q_lens.max()) == 1
        return out
    core.runner.collect = decode_steps_as_graphs
    core.add_request(core.make_request("g", [5, 6, 7, 8, 9], SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True)))
    while core.has_unfinished_requests():
        core.step()
    assert core.times.steps == 4 and core.times.graph_steps == 3     # the prompt's step eager
    assert core.get_stats().num_graph_steps == 3


def test_step_table_shows_graph_and_other_steps_gpu_time_where_timed():
    """scripts/bench_common.step_table: the GPU's ms per decode graph step, per step cut at
    attention and per eager step beside the phases; '-' where a run timed no GPU (CPU) or had
    no step of that kind."""
    from scripts.bench_common import step_table
    timed = StepTimes(steps=5, graph_steps=4, schedule=0.005, launch=0.025, wait=0.010, gpu=0.035,
                      graph_gpu=0.020, gpu_events=True).per_step_ms()
    cut = StepTimes(steps=5, graph_steps=4, piecewise_steps=1, schedule=0.005, gpu=0.050,
                    graph_gpu=0.035, piecewise_gpu=0.020, gpu_events=True).per_step_ms()
    untimed = StepTimes(steps=2, schedule=0.002, launch=0.002, wait=0.002).per_step_ms()
    head, rule, a, c, b = step_table([{"run": "gpu", "step_ms": timed},
                                      {"run": "cut", "step_ms": cut},
                                      {"run": "cpu", "step_ms": untimed}], ["run"])
    assert head.endswith("| GPU ms a decode graph step | GPU ms a cut step | GPU ms an eager step |")
    assert rule.count("|") == head.count("|")
    assert a.endswith("| 80% (0%) | 5.000 | - | 15.000 |"), a
    assert c.endswith("| 80% (20%) | 5.000 | 20.000 | 15.000 |"), c
    assert b.endswith("| 0% (0%) | - | - | - |"), b
    assert a.count("|") == b.count("|") == c.count("|") == head.count("|")
