"""scripts/bench_latency.py and profile_step.py on CPU with the tiny model: they run and say
where a step's time goes (a check that they work, not a timing). bench_throughput.py has its
own file, tests/test_bench_throughput.py."""
import json
import os
import subprocess
import sys

from engine.step_timing import PHASES
from scripts.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]


def test_latency_breaks_the_step_down(tmp_path):
    """... and its time to first token is a fresh prompt's: 40 tokens (2 whole 16-token blocks),
    a new prompt each run, so no run finds the one before it in the prefix cache."""
    model = make_tiny_model(tmp_path / "m", arch="llama", seed=4)
    out = tmp_path / "latency"
    _run("bench_latency.py", "--model", str(model), "--dtype", "float32", "--input-len", "40",
         "--output-len", "6", "--iters", "2", "--decode-late-merge", "false", "--kv-cache-dtype", "fp8",
         "--sampling", 'greedy={"temperature": 0}', 'top_p={"temperature": 0.8, "top_p": 0.9}',
         "--out", str(out))
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [(r["setting"], r["sampling"]) for r in rows] == [
        ("greedy", {"temperature": 0}), ("top_p", {"temperature": 0.8, "top_p": 0.9})]
    for row in rows:
        assert row["decode_late_merge"] is False        # the engine setting passed on (default true)
        assert row["kv_cache_dtype"] == "fp8"           # likewise (default auto)
        assert row["ttft_cached_tokens"] == [0, 0]      # each setting's runs have new prompts too
        assert row["step_ms"]["wall"] > 0 and all(row["step_ms"][p] > 0 for p in PHASES)
    assert "| top_p |" in out.with_suffix(".md").read_text()
    assert "Where a step's time goes" in out.with_suffix(".md").read_text()


def test_profile_step_keeps_requests_in_flight_and_breaks_the_step_down(tmp_path):
    """scripts/profile_step.py: a closed loop per scenario (waves and spread arrivals), output
    tok/s and the step breakdown of its measured steps."""
    model = make_tiny_model(tmp_path / "m", arch="llama", seed=4)
    out = tmp_path / "steady"
    _run("profile_step.py", "--model", str(model), "--dtype", "float32", "--scenarios",
         "2x8x8", "4x16x8j", "--steps", "12", "--warm-steps", "10", "--out", str(out))
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [(r["name"], r["concurrency"], r["jitter"]) for r in rows] == [
        ("2x8x8", 2, False), ("4x16x8j", 4, True)]
    for r in rows:
        assert r["steps"] == 12 and r["output_tok_s"] > 0
        assert all(r["step_ms"][p] > 0 for p in PHASES), r
    assert "| 4x16x8j |" in out.with_suffix(".md").read_text()


def test_a_step_trace_installed_after_the_profiler_sees_every_step():
    """bench_shared_prefix wraps core.step with the profiler, then the first-step clock and the
    step trace. The profiler's window ending set core.step back to what it had wrapped,
    dropping the two after it: with --profile-steps and --step-trace the trace held only the
    steps up to the window's end (e.g. 70 of 121 in cascade_decode_profile512_b06dfc4)."""
    import types

    from engine.step_timing import StepTimes
    from scripts.bench_common import FirstStepClock, StepProfiler, StepTrace

    class Core:
        device = types.SimpleNamespace(type="cuda")     # the profiler wraps only on a GPU

        def __init__(self):
            self.times, self.calls = StepTimes(), 0
            self.scheduler = types.SimpleNamespace(num_running=1)

        def step(self):
            self.calls += 1
            self.times.steps += 1
            return []

    class Profile:                                       # torch.profiler, without a GPU
        __enter__ = lambda self: self                     # noqa: E731
        __exit__ = lambda self, *a: False                 # noqa: E731
        events = lambda self: []                          # noqa: E731
        key_averages = lambda self: types.SimpleNamespace(table=lambda **k: "")  # noqa: E731

    core = Core()
    real_step = core.step
    profiler = StepProfiler(core, start=2, count=3)
    profiler._torch = types.SimpleNamespace(
        profiler=types.SimpleNamespace(profile=lambda activities: Profile(),
                                       ProfilerActivity=types.SimpleNamespace(CPU=0, CUDA=1)),
        cuda=types.SimpleNamespace(synchronize=lambda: None))
    first, trace = FirstStepClock(core), StepTrace(core)
    for _ in range(10):
        core.step()
    trace.close()
    first.close()
    profiler.close()
    assert core.calls == 10 and len(trace.rows) == 10
    assert profiler.tables["steps"] == 3
    assert core.step == real_step
