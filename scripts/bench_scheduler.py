"""Scheduler + block-pool time per step with N running requests (no model: a fake runner
returns one token per request). Target: under 1 ms per step at 256 running requests."""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.kv_cache_manager import KVCacheManager  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import ModelRunnerOutput, Scheduler  # noqa: E402


def bench(num_running: int, prompt_len: int, block_size: int, num_steps: int,
          caching: bool) -> dict:
    budget = 8192
    # Requests admitted early decode while later ones prefill: leave room for that too.
    max_tokens = num_steps + num_running * prompt_len // budget + 10
    max_model_len = prompt_len + max_tokens
    num_blocks = num_running * (-(-max_model_len // block_size)) + 64
    kv = KVCacheManager(num_blocks, block_size, caching)
    sched = Scheduler(kv, max_num_seqs=num_running, max_num_batched_tokens=budget,
                      max_model_len=max_model_len)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_running):
        sched.add_request(Request(str(i), [rng.randrange(32000) for _ in range(prompt_len)],
                                  params, eos_token_ids=[2]))
    # Prefill until every request is decoding.
    while any(r.num_computed_tokens < r.num_tokens - 1 or r.num_output_tokens == 0
              for r in sched.requests.values()):
        out = sched.schedule()
        done = [rid for rid in out.num_scheduled_tokens
                if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens]
        sched.update_from_output(out, ModelRunnerOutput(done, [1] * len(done)))
    assert sched.num_running == num_running
    schedule_s = update_s = 0.0
    for step in range(num_steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        rids = list(out.num_scheduled_tokens)
        runner_out = ModelRunnerOutput(rids, [(step * 7 + i) % 32000 for i in range(len(rids))])
        t2 = time.perf_counter()
        sched.update_from_output(out, runner_out)
        t3 = time.perf_counter()
        assert len(rids) == num_running
        schedule_s += t1 - t0
        update_s += t3 - t2
    return {
        "num_running": num_running, "prompt_len": prompt_len, "block_size": block_size,
        "prefix_caching": caching, "num_steps": num_steps,
        "schedule_ms_per_step": 1e3 * schedule_s / num_steps,
        "update_ms_per_step": 1e3 * update_s / num_steps,
        "total_ms_per_step": 1e3 * (schedule_s + update_s) / num_steps,
    }


def bench_abort(num_waiting: int, block_size: int) -> dict:
    """One abort_requests call for every waiting request, newest first (what a dropped peer or
    an interrupted LLM.generate sends)."""
    kv = KVCacheManager(1024, block_size, True)
    sched = Scheduler(kv, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)
    params = SamplingParams(max_tokens=8)
    for i in range(num_waiting):
        sched.add_request(Request(i, [1, 2, 3], params, eos_token_ids=[2]))
    t0 = time.perf_counter()
    sched.abort_requests(list(reversed(range(num_waiting))))
    return {"num_waiting": num_waiting, "abort_all_ms": 1e3 * (time.perf_counter() - t0)}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-running", type=int, nargs="+", default=[1, 64, 256, 1024])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-steps", type=int, default=200)
    ap.add_argument("--abort-waiting", type=int, nargs="*", default=[1000, 20000])
    ap.add_argument("--out", default="benchmarks/scheduler")
    args = ap.parse_args()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    rows = [bench(n, args.prompt_len, args.block_size, args.num_steps, c)
            for n in args.num_running for c in (True, False)]
    aborts = [bench_abort(n, args.block_size) for n in args.abort_waiting]
    meta = {"command": " ".join(["python"] + sys.argv), "commit": commit,
            "cpu": cpu_name(), "load_average": os.getloadavg()[0], "python": platform.python_version(),
            "target": "total_ms_per_step < 1.0 at num_running=256"}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": rows, "aborts": aborts}, f, indent=2)
    lines = ["# Scheduler + block pool time per decode step", "",
             f"commit `{commit}`, `{meta['command']}`, CPU {meta['cpu']} (load average "
             f"{meta['load_average']:.1f} at start), Python {meta['python']}.",
             f"Target: {meta['target']}. Prompt {args.prompt_len} tokens, block {args.block_size}.",
             "", "| running | prefix caching | schedule ms | update ms | total ms/step |",
             "| ---: | :---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['num_running']} | {'on' if r['prefix_caching'] else 'off'} | "
                     f"{r['schedule_ms_per_step']:.3f} | {r['update_ms_per_step']:.3f} | "
                     f"{r['total_ms_per_step']:.3f} |")
    if aborts:
        lines += ["", "One `abort_requests` call for every waiting request, newest first:", "",
                  "| waiting | ms |", "| ---: | ---: |"]
        lines += [f"| {a['num_waiting']} | {a['abort_all_ms']:.1f} |" for a in aborts]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
