"""scripts/proc_sampler.py: what it samples of a real process, and its summary."""
import json
import os
import subprocess
import sys
import time

from scripts import proc_sampler
from tests.waiting import wait_for

# A busy process whose command line names the engine core, as the sampler finds cores.
BUSY = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"


def test_a_busy_core_process_is_seen_running_its_whole_time(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", BUSY, "engine.core_process"])
    try:
        # On a busy machine it may not be seen at once.
        wait_for(lambda: str(proc.pid) in proc_sampler.sample()["cores"],
                 "the sampler to see the process")
        out = tmp_path / "cpu.jsonl"
        proc_sampler.record(str(out), interval=0.25, seconds=1.6)
    finally:
        proc.kill()
        proc.wait()
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(samples) >= 4
    summary = proc_sampler.summarize(samples)
    core = summary["engine_cores"][str(proc.pid)]
    # It never sleeps, so it is always runnable: on a CPU or waiting for one, the two adding
    # up to the wall time however busy the machine is (alone on CI's 2 cores it runs ~1.0;
    # beside two test workers, seen 0.40 run and 0.60 waiting). Its CPU seconds say the same
    # as its run time.
    assert 0.85 <= core["run"] + core["waiting_for_cpu"] <= 1.1, summary
    assert core["run"] > 0.05 and abs(core["cpu"] - core["run"]) < 0.1, summary
    assert summary["machine_busy_cpus"] >= core["run"] - 0.1, summary
    assert summary["seconds"] >= 1.0


def test_a_window_with_fewer_than_two_samples_says_nothing():
    now = time.time()
    samples = [dict(proc_sampler.sample(), t=now), dict(proc_sampler.sample(), t=now + 1)]
    assert proc_sampler.summarize(samples, (now + 0.5, now + 2)) == {}
    assert proc_sampler.summarize(samples)["seconds"] == 1.0


def test_it_runs_as_its_docstring_says():
    """`python scripts/proc_sampler.py ...` from the repository root (it imported `scripts.*`
    without the root on sys.path: ModuleNotFoundError)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "scripts/proc_sampler.py", "--help"], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--summarize" in r.stdout, r.stderr[-500:]
