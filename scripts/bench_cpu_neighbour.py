"""How much a busy neighbouring CPU slows the engine's step on this machine.

The engine (in process, one torch thread) runs pinned to one CPU, in rounds that alternate:
the other CPU idle, then running a process of ours: `spin` (a pure-Python loop: the core's
execution units, next to no memory traffic) or `memory` (numpy copying 64 MB back and forth:
the shared last-level cache and memory bandwidth). Where two "CPUs" are one physical core (SMT
siblings, as a VM may be given) spin slows the engine; where they share a cache and memory
that is busy, memory does. Either way, so does a server and a client beside the engine.

    python scripts/bench_cpu_neighbour.py                 # the tiny model, 32 x 128 tokens
    python scripts/bench_cpu_neighbour.py --rounds 5 --out benchmarks/cpu_neighbour
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import ROOT, git_commit, hardware, write_results  # noqa: E402



LOADS = {
    # Pure Python: the core's execution units, next to no memory traffic.
    "spin": "while True:\n    pass\n",
    # Copies of 64 MB back and forth: the shared last-level cache and memory bandwidth.
    "memory": ("import numpy as np\na = np.ones(1 << 23)\nb = np.empty_like(a)\n"
               "while True:\n    np.copyto(b, a)\n    np.copyto(a, b)\n"),
}


def start_neighbour(cpu: int, load: str) -> subprocess.Popen:
    """A process running `load` on `cpu`; it says "ready" once pinned."""
    code = (f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nprint('ready', flush=True)\n"
            + LOADS[load])
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise SystemExit(f"the neighbour process could not start on CPU {cpu}")
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    proc.stdout.close()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a local model folder (default: the tiny "
                    "model, made if missing)")
    ap.add_argument("--prompts", type=int, default=32, help="requests per round, all at once")
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each kind")
    ap.add_argument("--loads", nargs="+", choices=sorted(LOADS), default=sorted(LOADS),
                    help="what the neighbour runs in its rounds (besides idle ones)")
    ap.add_argument("--engine-cpu", type=int, default=None, help="default: the first usable")
    ap.add_argument("--neighbour-cpu", type=int, default=None, help="default: the next one")
    ap.add_argument("--out", default="benchmarks/cpu_neighbour")
    args = ap.parse_args(argv)

    cpus = sorted(os.sched_getaffinity(0))
    engine_cpu = cpus[0] if args.engine_cpu is None else args.engine_cpu
    others = [c for c in cpus if c != engine_cpu]
    neighbour_cpu = others[0] if args.neighbour_cpu is None and others else args.neighbour_cpu
    if neighbour_cpu is None or neighbour_cpu == engine_cpu:
        raise SystemExit(f"needs two CPUs: this process may use {cpus}")

    import torch
    from engine import LLM, SamplingParams

    model = args.model
    if model is None:
        from scripts.make_tiny_model import make_tiny_model
        model = os.path.join(ROOT, "models", "tiny-llama")     # bench_serving's on CPU
        if not os.path.isdir(model):
            make_tiny_model(model)
    os.sched_setaffinity(0, {engine_cpu})
    torch.set_num_threads(1)
    llm = LLM(model, dtype="float32", device="cpu", cpu_threads=1,
              max_num_seqs=args.prompts, num_kv_blocks=64 * args.prompts)
    prompts = [f"Request {i}: tell me about the number {i * 7}." for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, params)                   # warm-up

    kinds = ["idle", *args.loads]
    rows = []
    for r in range(args.rounds):
        for kind in kinds:
            neighbour = None if kind == "idle" else start_neighbour(neighbour_cpu, kind)
            try:
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params)
                seconds = time.perf_counter() - t0
            finally:
                if neighbour is not None:
                    stop(neighbour)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append({"round": r, "neighbour": kind, "seconds": seconds,
                         "output_tok_s": tokens / seconds})
            print(f"round {r} neighbour {kind}: {rows[-1]['output_tok_s']:.0f} tok/s", flush=True)

    median = {kind: statistics.median(x["output_tok_s"] for x in rows if x["neighbour"] == kind)
              for kind in kinds}
    vs_idle = {kind: median[kind] / median["idle"] for kind in args.loads}
    table = [f"Engine on CPU {engine_cpu}; on CPU {neighbour_cpu} nothing (idle) or a process of "
             f"ours: spin = a pure-Python loop, memory = numpy copying 64 MB back and forth. "
             f"{args.prompts} requests x {args.output_tokens} tokens a round, "
             f"{os.path.basename(os.path.normpath(model))}, float32, one torch thread.", "",
             "| round | " + " | ".join(f"{k} tok/s" for k in kinds) + " |",
             "| ---: |" + " ---: |" * len(kinds)]
    for r in range(args.rounds):
        got = {x["neighbour"]: x["output_tok_s"] for x in rows if x["round"] == r}
        table.append(f"| {r} | " + " | ".join(f"{got[k]:.0f}" for k in kinds) + " |")
    table.append("| median | " + " | ".join(
        f"{median[k]:.0f}" + ("" if k == "idle" else f" (**{vs_idle[k]:.2f}x**)")
        for k in kinds) + " |")
    meta = {"title": "The engine's speed beside a busy neighbouring CPU",
            "hardware": {**hardware(), "cpus": cpus}, "commit": git_commit(),
            "command": "python scripts/bench_cpu_neighbour.py " + " ".join(
                argv if argv is not None else sys.argv[1:]),
            "engine_cpu": engine_cpu, "neighbour_cpu": neighbour_cpu,
            "median_output_tok_s": median, "vs_idle": vs_idle}
    write_results(args.out, meta, rows, table)
    return {"meta": meta, "results": rows}


if __name__ == "__main__":
    main()
