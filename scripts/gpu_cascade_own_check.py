"""The cascade cost rule's own-pass check (`CascadeCostRule.own_pass_fills`) in the engine (issue
12), on a GPU: one engine in groups mode (prefix groups + cascade + prefix caching), each case run
twice, once with the check as it is and once with it forced true (the rule before 3c1979a: bytes
alone), in alternating order. A case is ROWSxOWNxDEGREE: ROWS requests in groups of DEGREE over a
shared prefix, each with OWN tokens of its own, greedy, all started at once (one wave). Reports
requests/s, the GPU ms of a decode graph step and the cascade rows of each run.

    PYTHONPATH=. python3 scripts/gpu_cascade_own_check.py --cases 32x4000x16 16x4000x16 --out $OUT/own_check.json

`--quick`: a tiny model on CPU with a rule whose thresholds its sizes reach (a smoke test).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels.cascade_cost as cascade_cost  # noqa: E402
from scripts.bench_common import PRESETS, git_commit, hardware, preset_dir  # noqa: E402
from scripts.bench_shared_prefix import make_prompts  # noqa: E402


def parse_case(text: str) -> tuple[int, int, int]:
    rows, own, degree = (int(x) for x in text.split("x"))
    if rows % degree:
        raise SystemExit(f"case {text}: rows must be a multiple of the group size")
    return rows, own, degree


def make_engine(args, max_len: int):
    """(engine, model config): Llama-3.1-8B's shape with dummy weights on the GPU, or with
    --quick a tiny model on CPU whose cascade rule takes every shared prefix and calls own parts
    of 8 tokens long (its sizes reach no real threshold)."""
    from engine import LLM
    settings = dict(max_model_len=-(-max_len // 16) * 16, skip_tokenizer_init=True,
                    enable_prefix_caching=True, enable_prefix_groups=True, enable_cascade_attention=True)
    if not args.quick:
        llm = LLM(preset_dir("llama-3.1-8b"), dtype="bfloat16", load_format="dummy", max_num_seqs=256,
                  max_num_batched_tokens=8192, **settings)
        return llm, PRESETS["llama-3.1-8b"]
    from scripts.make_tiny_model import make_tiny_model
    model = str(make_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"), arch="llama", seed=1))
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    llm = LLM(model, dtype="float32", device="cpu", max_num_seqs=8, max_num_batched_tokens=64, **settings)
    c = llm.core.runner.cascade
    c.rule = cascade_cost.CascadeCostRule(c.num_q_heads, c.num_kv_heads, c.head_dim, kv_dtype_bytes=4,
                                          min_prefix_len=0, min_saved_bytes=0, per_group_bytes=0,
                                          long_own_len=8)
    return llm, cfg


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", type=parse_case, default=None, help="ROWSxOWNxDEGREE")
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="a tiny model on CPU (a smoke test)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.quick:
        args.cases, args.prefix_len, args.output_len = args.cases or [(8, 16, 4)], 64, 4
    if not args.cases:
        raise SystemExit("--cases: at least one ROWSxOWNxDEGREE")
    from engine import SamplingParams
    max_len = args.prefix_len + max(own for _, own, _ in args.cases) + args.output_len
    llm, cfg = make_engine(args, max_len)
    warm = make_prompts(dict(degree=4, prefix=64, own=16, num_requests=8), "grouped", cfg["vocab_size"], seed=99)
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    check = cascade_cost.CascadeCostRule.own_pass_fills
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    results = []
    try:
        for i, (rows, own, degree) in enumerate(args.cases):
            for j, variant in enumerate(("check", "no_check") if i % 2 == 0 else ("no_check", "check")):
                cascade_cost.CascadeCostRule.own_pass_fills = (
                    check if variant == "check" else lambda self, tiles, longest: True)
                w = dict(degree=degree, prefix=args.prefix_len, own=own, num_requests=rows)
                prompts = make_prompts(w, "grouped", cfg["vocab_size"], seed=1000 * i + j)
                llm.core.kv.pool.reset_prefix_cache()
                before = llm.get_stats()
                llm.core.times.gpu_events = True
                times = llm.core.times.copy()
                t0 = time.perf_counter()
                llm.generate(prompts, params)
                elapsed = time.perf_counter() - t0
                after = llm.get_stats()
                step = llm.core.times.since(times).per_step_ms()
                r = dict(rows=rows, own_len=own, degree=degree, prefix_len=args.prefix_len,
                         output_len=args.output_len, variant=variant, elapsed_s=elapsed,
                         requests_per_s=rows / elapsed, step_ms=step,
                         cascade_rows=after.num_cascade_rows - before.num_cascade_rows)
                results.append(r)
                print(f"{rows:3d} rows, own {own:5d}, groups of {degree:3d}, {variant:>8}: "
                      f"{rows / elapsed:6.2f} req/s, graph step {step.get('gpu_graph_step', float('nan')):7.3f} ms, "
                      f"cascade rows {r['cascade_rows']}", flush=True)
    finally:
        cascade_cost.CascadeCostRule.own_pass_fills = check
        llm.core.shutdown()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"commit": git_commit(), "hardware": hardware(), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
