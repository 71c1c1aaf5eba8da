"""What each sampling setting costs (issue 13: sampling "without a host sync per step, no
per-request Python on the hot path"): one engine, one offline workload, run once per setting,
output tok/s beside greedy's and where a step's time went.

Settings are named SamplingParams fields (max_tokens and ignore_eos come from the workload):

    python scripts/bench_sampling.py --workload 1000x500 --num-prompts 256 --max-num-seqs 256 \\
        --out benchmarks/sampling

Default settings: greedy; temperature 0.8 with top-p 0.95 (one shared generator); the same with a
seed per request; repetition + frequency penalties on greedy.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from bench_common import (add_model_args, add_scheduling_arg, git_commit, hardware, model_and_config,
                          parse_setting, step_table, write_results)

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "top_p": {"temperature": 0.8, "top_p": 0.95},
    "top_p_seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 1},
    "penalties": {"temperature": 0.0, "repetition_penalty": 1.1, "frequency_penalty": 0.2},
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--workload", default="1000x500", help="INPUTxOUTPUT lengths")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--settings", type=parse_setting, nargs="+", metavar="NAME=JSON",
                    default=list(SETTINGS.items()), help="sampling settings, each run in turn")
    ap.add_argument("--out", default="benchmarks/sampling")
    add_scheduling_arg(ap)
    args = ap.parse_args(argv)

    from bench_throughput import workload_prompts
    from engine import LLM, SamplingParams
    model_dir, cfg = model_and_config(args.preset, args.model)
    inp, out = (int(x) for x in args.workload.split("x"))
    prompts = workload_prompts(cfg, [(inp, out)], args.num_prompts)[(inp, out)]
    llm = LLM(model_dir, load_format="dummy", dtype=args.dtype, skip_tokenizer_init=True,
              max_num_seqs=args.max_num_seqs, max_model_len=inp + out, enable_prefix_caching=False,
              async_scheduling=not args.sync_scheduling, kv_cache_dtype=args.kv_cache_dtype)
    llm.core.times.gpu_events = True
    meta = {"title": f"Sampling settings, {args.preset if not args.model else args.model} ({args.dtype}), "
                     f"{args.workload} x {args.num_prompts} at max_num_seqs {args.max_num_seqs}",
            "hardware": hardware(), "commit": git_commit(), "command": " ".join(["python"] + sys.argv)}
    rows = []
    for name, fields in args.settings:
        params = SamplingParams(**(fields | {"max_tokens": out, "ignore_eos": True}))
        llm.generate(prompts[:8], SamplingParams(**(fields | {"max_tokens": 8, "ignore_eos": True})))  # warm-up
        before = llm.core.times.copy()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == out for o in outs)
        rows.append({"setting": name, "sampling": fields, "engine_s": elapsed,
                     "output_tok_s": args.num_prompts * out / elapsed,
                     "step_ms": llm.core.times.since(before).per_step_ms()})
    base = next((r for r in rows if r["setting"] == "greedy"), rows[0])
    for r in rows:
        r["vs_" + base["setting"]] = r["output_tok_s"] / base["output_tok_s"]
    table = ["| setting | SamplingParams | out tok/s | engine s | vs " + base["setting"] + " |",
             "| --- | --- | ---: | ---: | ---: |"]
    table += [f"| {r['setting']} | `{json.dumps(r['sampling'])}` | {r['output_tok_s']:.0f} | {r['engine_s']:.2f} | "
              f"{r['vs_' + base['setting']]:.3f} |" for r in rows]
    write_results(args.out, meta, rows, table + ["", "Where a step's time goes (ms a step):", ""]
                  + step_table(rows, ["setting"]))


if __name__ == "__main__":
    main()
