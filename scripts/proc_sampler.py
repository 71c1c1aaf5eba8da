"""Whether the engine cores get the CPU they need while a benchmark runs (Linux /proc).

A served step's host phases (schedule, prepare, launch) can run twice as long as the same
step's in a direct run on the same machine (benchmarks/h200x2/served_shared_prefix.md). This
samples, every --interval seconds until stopped (SIGTERM, SIGINT or --seconds):

  per kind of process (server_probe.cpu_times): CPU seconds used;
  per engine core process: CPU seconds, and over all its threads the time run on a CPU and the
    time spent runnable but waiting for one (/proc/PID/task/*/schedstat), involuntary context
    switches, the CPU it last ran on and the CPUs it may run on;
  the cgroup's CPU quota and throttling (cpu.max, cpu.stat), the machine's busy CPUs.

    python scripts/proc_sampler.py --out run.cpu.jsonl &      (then the benchmark; kill %1)
    python scripts/proc_sampler.py --summarize run.cpu.jsonl [--window T0 T1]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:        # run as `python scripts/proc_sampler.py`
    sys.path.insert(0, ROOT)

from scripts.bench_common import process_cmdlines  # noqa: E402
from scripts.server_probe import cpu_times  # noqa: E402

CGROUP = "/sys/fs/cgroup"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def schedstat(pid: int) -> tuple[int, int]:
    """(ns run on a CPU, ns runnable and waiting), summed over the process's threads."""
    run = wait = 0
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        text = _read(path)
        if text:
            r, w = text.split()[:2]
            run, wait = run + int(r), wait + int(w)
    return run, wait


def core_sample(pid: int) -> dict | None:
    stat, status = _read(f"/proc/{pid}/stat"), _read(f"/proc/{pid}/status")
    if not stat or not status:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    fields_of = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    run, wait = schedstat(pid)
    return {"cpu_s": (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"),
            "run_ns": run, "wait_ns": wait, "last_cpu": int(fields[36]),
            "nonvoluntary": int(fields_of.get("nonvoluntary_ctxt_switches", "0")),
            "cpus_allowed": fields_of.get("Cpus_allowed_list", "").strip()}


def cgroup_sample() -> dict:
    out = {"cpu.max": (_read(f"{CGROUP}/cpu.max") or "").strip()}
    for line in (_read(f"{CGROUP}/cpu.stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the machine so far (/proc/stat)."""
    values = [int(x) for x in (_read("/proc/stat") or "cpu 0").splitlines()[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = sum(values[3:5])          # idle, iowait
    return (sum(values) - idle) / tick, sum(values) / tick


def sample() -> dict:
    cores = {}
    for pid, cmd in process_cmdlines():
        if "engine.core_process" in cmd:
            s = core_sample(pid)
            if s:
                cores[str(pid)] = s
    busy, total = machine_busy_s()
    return {"t": time.time(), "kinds": cpu_times(), "cores": cores, "cgroup": cgroup_sample(),
            "machine_busy_s": busy, "machine_total_s": total}


def record(out: str, interval: float, seconds: float | None) -> None:
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    end = time.monotonic() + seconds if seconds else float("inf")
    with open(out, "a") as f:
        while not stop and time.monotonic() < end:
            f.write(json.dumps(sample()) + "\n")
            f.flush()
            time.sleep(interval)


def summarize(samples: list[dict], window: tuple[float, float] | None = None) -> dict:
    """Between the first and last sample in the window: cores used per kind, per engine core
    its share of the wall time run on a CPU and spent waiting for one, the cgroup's throttled
    share, the machine's busy CPUs."""
    if window:
        samples = [s for s in samples if window[0] <= s["t"] <= window[1]]
    if len(samples) < 2:
        return {}
    a, b = samples[0], samples[-1]
    wall = b["t"] - a["t"]
    out = {"seconds": round(wall, 1),
           "cores_by_kind": {k: round((v - a["kinds"].get(k, 0.0)) / wall, 2)
                             for k, v in sorted(b["kinds"].items())},
           "machine_busy_cpus": round((b["machine_busy_s"] - a["machine_busy_s"]) / wall, 2)}
    cores = {}
    for pid, s in b["cores"].items():
        s0 = a["cores"].get(pid)
        if s0:
            cores[pid] = {"cpu": round((s["cpu_s"] - s0["cpu_s"]) / wall, 3),
                          "run": round((s["run_ns"] - s0["run_ns"]) / 1e9 / wall, 3),
                          "waiting_for_cpu": round((s["wait_ns"] - s0["wait_ns"]) / 1e9 / wall, 3),
                          "nonvoluntary_per_s": round((s["nonvoluntary"] - s0["nonvoluntary"])
                                                      / wall, 1),
                          "cpus_allowed": s["cpus_allowed"]}
    out["engine_cores"] = cores
    ga, gb = a["cgroup"], b["cgroup"]
    out["cgroup_cpu_max"] = gb.get("cpu.max", "")
    if "nr_periods" in gb and gb["nr_periods"] > ga.get("nr_periods", 0):
        out["cgroup_throttled_periods"] = round(
            (gb["nr_throttled"] - ga["nr_throttled"]) / (gb["nr_periods"] - ga["nr_periods"]), 3)
        out["cgroup_throttled_s_per_s"] = round(
            (gb.get("throttled_usec", 0) - ga.get("throttled_usec", 0)) / 1e6 / wall, 3)
    return out


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="append samples here (JSON lines)")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=None, help="stop after this long")
    ap.add_argument("--summarize", metavar="JSONL")
    ap.add_argument("--window", type=float, nargs=2, metavar=("T0", "T1"),
                    help="unix times: summarize only the samples between")
    args = ap.parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            result = summarize([json.loads(line) for line in f if line.strip()],
                               tuple(args.window) if args.window else None)
        print(json.dumps(result, indent=1))
        return result
    if not args.out:
        ap.error("--out or --summarize")
    record(args.out, args.interval, args.seconds)
    return None


if __name__ == "__main__":
    main()
