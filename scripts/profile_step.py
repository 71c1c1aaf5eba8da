"""Where a step's time goes in a steady state, in process (issues 11 and 13).

A closed loop over the EngineCore (async scheduling unless `--sync-scheduling`) keeps
`--concurrency` requests in flight: when one finishes the next starts at once, as a load
generator would. With `--jitter 0` every request
has the same output length, so requests start and finish in waves (a wave's prompts, then pure
decode steps: CUDA graphs); with jitter the output lengths vary and arrivals spread out, as they
do behind a server: most steps then carry a prompt chunk beside the decode rows (a mixed step).
Each scenario reports output tok/s, the step breakdown (engine/step_timing.py, the GPU's time
by CUDA events), the share of graph steps, and, with `--profile-steps`, the top CUDA kernels
and host ops of a few steps (torch.profiler).

  python scripts/profile_step.py --scenarios 1x128x128 256x215x128 256x215x128j
    (CONCURRENCYxPROMPTxOUTPUT, a trailing j: output lengths uniform in [OUT/2, 3*OUT/2])

With `--shared-prefix-tokens N` each `--group-size` requests in turn start with the same N
tokens (prefix caching, groups and cascade attention on), as bench_serving's shared-prefix
workload sends them: a served engine's steps, in process.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

from bench_common import (StepProfiler, add_model_args, add_pdl_arg, add_scheduling_arg, git_commit,
                          hardware, model_and_config, pdl_setting, step_table, write_results)

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams


def parse_scenario(text: str) -> dict:
    jitter = text.endswith("j")
    c, p, o = (int(x) for x in text.rstrip("j").split("x"))
    return {"name": text, "concurrency": c, "prompt_len": p, "output_len": o, "jitter": jitter}


def closed_loop(core: EngineCore, sc: dict, vocab: int, num_steps: int, warm_steps: int,
                rng: random.Random, profile_steps: int = 0, shared_prefix: int = 0,
                group_size: int = 16) -> dict:
    """Runs warm_steps, then num_steps measured (the last profile_steps of them profiled).
    shared_prefix: each group_size requests in turn start with the same that many tokens (a
    new prefix per group), before their own prompt_len."""
    c, p, o = sc["concurrency"], sc["prompt_len"], sc["output_len"]
    ids = iter(range(10**9))
    prefixes: dict[int, list[int]] = {}

    def submit() -> None:
        out_len = rng.randint(max(1, o // 2), o * 3 // 2) if sc["jitter"] else o
        k = next(ids)
        prompt = []
        if shared_prefix:
            prefixes.pop(k // group_size - 2, None)         # groups long done
            prompt = prefixes.setdefault(k // group_size,
                                         [rng.randrange(vocab) for _ in range(shared_prefix)])
        prompt = prompt + [rng.randrange(vocab) for _ in range(p)]
        params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
        core.add_request(core.make_request(f"r{k}", prompt, params))

    for _ in range(c):
        submit()
    tokens = 0
    before = None
    t0 = 0.0
    prof = StepProfiler(core, warm_steps + num_steps - profile_steps, profile_steps)
    for i in range(warm_steps + num_steps):
        if i == warm_steps:
            core.times.gpu_events = True
            before = core.times.copy()
            tokens = 0
            t0 = time.perf_counter()
        outs = core.step()
        if i >= warm_steps:
            tokens += sum(len(x.new_token_ids) for x in outs)
        for x in outs:
            if x.finished:
                submit()
    elapsed = time.perf_counter() - t0
    prof.close()
    step = core.times.since(before).per_step_ms()
    core.times.gpu_events = False
    row = {**sc, "steps": num_steps, "output_tok_s": tokens / elapsed,
           "step_ms": step}
    if prof.tables is not None:
        row["profile"] = prof.tables
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--scenarios", nargs="+", default=["1x128x128", "256x215x128",
                                                       "256x215x128j"])
    ap.add_argument("--steps", type=int, default=300, help="measured steps per scenario")
    ap.add_argument("--warm-steps", type=int, default=300,
                    help="steps before measuring (jittered arrivals need a while to spread)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="profile the last N measured steps (torch.profiler; GPU only)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--shared-prefix-tokens", type=int, default=0,
                    help="each --group-size requests in turn share a prefix this long (prefix "
                         "caching, groups and cascade on), before their own prompt")
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--piecewise-graph-max-tokens", type=int, default=None,
                    help="EngineConfig.piecewise_graph_max_tokens (default: the engine's)")
    add_scheduling_arg(ap)
    add_pdl_arg(ap)
    ap.add_argument("--out", default="benchmarks/profile_step")
    args = ap.parse_args(argv)

    model_dir, cfg = model_and_config(args.preset, args.model)
    scenarios = [parse_scenario(s) for s in args.scenarios]
    max_len = max(s["prompt_len"] + s["output_len"] * 3 // 2 for s in scenarios)
    max_len += args.shared_prefix_tokens
    piecewise = ({} if args.piecewise_graph_max_tokens is None
                 else {"piecewise_graph_max_tokens": args.piecewise_graph_max_tokens})
    config = EngineConfig(model=model_dir, load_format="dummy", dtype=args.dtype,
                          skip_tokenizer_init=True, max_num_seqs=args.max_num_seqs,
                          max_model_len=max_len,
                          enable_prefix_caching=args.shared_prefix_tokens > 0, **piecewise,
                          enforce_eager=args.enforce_eager,
                          async_scheduling=not args.sync_scheduling,
                          kv_cache_dtype=args.kv_cache_dtype, **pdl_setting(args))
    core = EngineCore(config)
    rng = random.Random(0)
    rows = []
    for sc in scenarios:
        row = closed_loop(core, sc, cfg["vocab_size"], args.steps, args.warm_steps, rng,
                          args.profile_steps if core.device.type == "cuda" else 0,
                          args.shared_prefix_tokens, args.group_size)
        core.abort_requests([r for r in list(core.scheduler.requests)])
        while core.has_unfinished_requests():
            core.step()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        if "profile" in row:
            print(row["profile"]["cuda"], flush=True)
            print(row["profile"]["cpu"], flush=True)
    meta = {"title": f"Steady-state steps, {args.model or args.preset} ({args.dtype}, dummy weights)",
            "hardware": hardware(), "commit": git_commit(),
            "command": " ".join(["python"] + sys.argv)}
    table = ["| scenario | output tok/s |", "| --- | ---: |"]
    table += [f"| {r['name']} | {r['output_tok_s']:.0f} |" for r in rows]
    table += ["", "Where a step's time goes (ms per step):", ""]
    table += step_table(rows, ["name"])
    write_results(args.out, meta, rows, table)
    return rows


if __name__ == "__main__":
    main()
