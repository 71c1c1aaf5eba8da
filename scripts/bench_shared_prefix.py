"""Shared-prefix throughput (issue 12, the BatchLLM RFC workload): requests in groups that share a
long prefix (a system prompt, a document, few-shot examples), each with its own part and output.

Modes, each its own engine (same settings otherwise):
  off     prefix caching off: every prompt computed whole, every prefix read per request
  apc     automatic prefix caching alone (no prefix groups, no cascade attention)
  groups  prefix groups (each prefix computed once, pinned while its group runs) + cascade
          attention (a group's prefix read once per step) + prefix caching
Orders: grouped (a group's requests next to each other) or shuffled (random.Random(0)).

Workloads: `rfc` (6400 requests in groups of 16, 2000 shared + 200 own tokens, 100 out) and the
sweep `g{degree}-p{prefix}` over sharing degrees 4/16/64 and prefixes 500/2000/8000 (200 own, 100
out). Each run reports requests/s and output tok/s beside the job's compute-and-bytes floor:
prefill FLOPs with each prefix computed once at the bf16 peak, plus decode steps at full batch
reading the weights once and each group's prefix once (own and output tokens per request) at the
HBM peak (the two phases added: steps mixing prompt chunks with decode rows can beat the sum,
benchmarks/roofline_correction.md). Random token ids, dummy weights, greedy, ignore_eos.

One GPU call must stay under 10 minutes: pick workloads, modes and orders with flags, write each
part to its own file, and merge them (`--merge a.json b.json --out benchmarks/h200/shared_prefix`).
`--quick`: a tiny model on CPU, a few requests (a smoke test of this script).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from scripts.bench_common import (BF16_DENSE_FLOPS, HBM_BYTES_PER_S, PRESETS,  # noqa: E402
                                  FirstStepClock, StepProfiler, StepTrace, git_commit, hardware,
                                  kv_bytes_per_token, preset_dir, step_table, weight_cost,
                                  write_results)
from engine.config import QUANTIZATIONS  # noqa: E402

MODES = {"off": dict(enable_prefix_caching=False, enable_prefix_groups=False,
                     enable_cascade_attention=False),
         "apc": dict(enable_prefix_caching=True, enable_prefix_groups=False,
                     enable_cascade_attention=False),
         "groups": dict(enable_prefix_caching=True, enable_prefix_groups=True,
                        enable_cascade_attention=True)}
ORDERS = ("grouped", "shuffled")
SWEEP_DEGREES = (4, 16, 64)
RFC_OWN, RFC_OUT = 200, 100            # the RFC workload's own and output tokens a request
SWEEP_PREFIXES = (500, 2000, 8000)


def parse_workload(name: str, num_requests: int | None, own: int, out: int) -> dict:
    if name == "rfc":                  # whole groups, as the sweep: what make_prompts sends
        if (own, out) != (RFC_OWN, RFC_OUT):
            raise SystemExit(f"workload 'rfc' is the RFC's {RFC_OWN} own and {RFC_OUT} output "
                             f"tokens; --own-len and --output-len are for g<degree>-p<prefix> "
                             f"workloads (e.g. g16-p2000)")
        n = max(16, (num_requests or 6400) // 16 * 16)
        return dict(name="rfc", degree=16, prefix=2000, own=RFC_OWN, out=RFC_OUT, num_requests=n)
    try:
        degree, prefix = name.split("-")
        degree, prefix = int(degree.removeprefix("g")), int(prefix.removeprefix("p"))
        if degree < 1 or prefix < 1 or own < 1 or out < 1:
            raise ValueError
    except ValueError:
        raise SystemExit(f"workload {name!r} (own {own}, output {out}): expected 'rfc', 'sweep' "
                         f"or 'g<degree>-p<prefix>', each length at least 1")
    # Sweep sizes: long prefixes get fewer requests so each run stays near a minute.
    n = num_requests or (512 if prefix > 4000 else 1024)
    n = max(degree, n // degree * degree)
    return dict(name=name, degree=degree, prefix=prefix, own=own, out=out, num_requests=n)


def make_prompts(w: dict, order: str, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lo = min(1000, vocab // 4)                     # clear of the special tokens
    tok = lambda n: [rng.randrange(lo, vocab) for _ in range(n)]  # noqa: E731
    prompts = []
    for _ in range(w["num_requests"] // w["degree"]):
        prefix = tok(w["prefix"])
        prompts += [prefix + tok(w["own"]) for _ in range(w["degree"])]
    if order == "shuffled":
        random.Random(0).shuffle(prompts)
    return prompts


def floor_s(cfg: dict, w: dict, batch: int, elem: int, quantization: str | None = None) -> float:
    """The job's compute-and-bytes floor (module docstring); FP8 projections' bytes at one a
    parameter and FLOPs at the FP8 peak (bench_common.weight_cost)."""
    wc = weight_cost(cfg, elem, quantization)
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    attn = 4 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * d   # FLOPs per (query, key)
    n, prefix, own, out = w["num_requests"], w["prefix"], w["own"], w["out"]
    groups = n / w["degree"]
    decode = max(out - 1, 0)        # the first output token comes from the prompt's step
    prefill_s = (wc.s_per_prompt_token * (groups * prefix + n * own) + n * wc.s_per_sequence
                 + attn * (groups * prefix ** 2 / 2 + n * own * (prefix + own / 2)) / BF16_DENSE_FLOPS)
    decode_flops_s = n * decode * (wc.s_per_token + attn * (prefix + own + out / 2) / BF16_DENSE_FLOPS)
    steps = -(-n // batch) * decode
    decode_bytes = (steps * wc.bytes
                    + kv_bytes_per_token(cfg, elem) * decode * (groups * prefix + n * (own + out / 2)))
    return prefill_s + max(decode_bytes / HBM_BYTES_PER_S, decode_flops_s)


def run_mode(mode: str, workloads: list[dict], orders: list[str], args, model: str, cfg: dict,
             elem: int, deadline: float, done) -> list[dict]:
    """Runs every workload and order on one engine; `done(row)` after each run."""
    from engine import LLM, SamplingParams
    max_len = max(w["prefix"] + w["own"] + w["out"] for w in workloads)
    settings = dict(load_format="dummy") if not args.quick else dict(device="cpu")
    if args.gpu_memory_utilization is not None:
        settings["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.num_kv_blocks is not None:
        settings["num_kv_blocks"] = args.num_kv_blocks
    t0 = time.perf_counter()
    llm = LLM(model, dtype=args.dtype, quantization=args.quantization, skip_tokenizer_init=True,
              max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=-(-max_len // 16) * 16, **MODES[mode], **settings)
    start_s = time.perf_counter() - t0
    if args.force_cascade and mode == "groups":
        from tests.test_prefix_sharing import force_cascade
        force_cascade(llm)
    print(f"[{mode}] engine ready in {start_s:.1f} s", flush=True)
    warm = make_prompts(dict(degree=4, prefix=64, own=16, num_requests=8), "grouped",
                        cfg["vocab_size"], seed=99)
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    rows = []
    for w in workloads:
        for order in orders:
            if time.perf_counter() > deadline:
                print(f"[{mode}] time limit: skipping {w['name']} {order}", flush=True)
                continue
            prompts = make_prompts(w, order, cfg["vocab_size"])
            llm.core.kv.pool.reset_prefix_cache()   # no hits from an earlier run
            before = llm.get_stats()
            params = SamplingParams(max_tokens=w["out"], temperature=0.0, ignore_eos=True)
            llm.core.times.gpu_events = True     # where each step's time goes, the GPU's included
            times = llm.core.times.copy()
            prof = StepProfiler(llm.core, args.profile_after, args.profile_steps,
                                f"{args.out}_kernels_{w['name']}_{mode}_{order}.json" if args.profile_kernels else None)
            first_step = FirstStepClock(llm.core)
            trace = StepTrace(llm.core) if args.step_trace else None
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - t0
            if trace is not None:
                trace.close()
            first_step.close()
            prof.close()
            step_times = llm.core.times.since(times)
            after = llm.get_stats()
            n = w["num_requests"]
            assert len(outs) == n and all(len(o.outputs[0].token_ids) == w["out"] for o in outs)
            floor = floor_s(cfg, w, args.max_num_seqs, elem, args.quantization)
            row = dict(workload=w["name"], degree=w["degree"], prefix_len=w["prefix"],
                       own_len=w["own"], output_len=w["out"], num_requests=n, order=order,
                       mode=mode, elapsed_s=elapsed, requests_per_s=n / elapsed,
                       output_tok_per_s=n * w["out"] / elapsed,
                       computed_prompt_tokens=after.num_computed_prompt_tokens
                       - before.num_computed_prompt_tokens,
                       cascade_rows=after.num_cascade_rows - before.num_cascade_rows,
                       preemptions=after.num_preemptions - before.num_preemptions,
                       steps=after.num_steps - before.num_steps, floor_s=floor,
                       floor_requests_per_s=n / floor, fraction_of_floor=floor / elapsed,
                       engine_start_s=start_s,
                       # Host time before the first step (prompt intake), and outside steps in all
                       intake_s=first_step.t - t0, intake_phases_s=dict(llm.intake_s),
                       outside_steps_s=elapsed - step_times.wall_s(),
                       step_ms=step_times.per_step_ms())
            if trace is not None:
                row["step_trace"] = trace.summary()
                trace.write(f"{args.out}_trace_{w['name']}_{mode}_{order}.json")
            print(json.dumps(row), flush=True)
            if prof.tables is not None:
                row["profile"] = prof.tables
                print(prof.tables["cuda"], prof.tables["cpu"], sep="\n", flush=True)
            rows.append(row)
            done(row)
    llm.core.shutdown()
    return rows


def label(name: str, degree: int, prefix: int) -> str:
    return name if name == "rfc" else f"{degree} x {prefix}"


def table(rows: list[dict]) -> list[str]:
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in rows:     # modes may run at different sizes (off is slow): rates compare per request
        by_key.setdefault((r["workload"], r["degree"], r["prefix_len"], r["order"]),
                          {})[r["mode"]] = r
    out = ["| workload | requests (off / apc / groups) | order | off req/s | apc req/s | groups req/s | "
           "groups out tok/s | groups vs off | groups vs apc | floor req/s | groups % of floor | "
           "prompt tokens computed (off / apc / groups) | cascade rows |",
           "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]

    def get(m, mode, key, fmt):
        return fmt.format(m[mode][key]) if mode in m else "-"

    def ratio(m, a, b):
        return f"{m[a]['requests_per_s'] / m[b]['requests_per_s']:.2f}x" if a in m and b in m else "-"
    for (name, degree, prefix, order), m in sorted(
            by_key.items(), key=lambda kv: (kv[0][0] != "rfc", kv[0][1], kv[0][2], kv[0][3])):
        any_row = m.get("groups", next(iter(m.values())))
        n = " / ".join(str(m[k]["num_requests"]) if k in m else "-" for k in MODES)
        out.append(
            f"| {label(name, degree, prefix)} | {n} | {order} | {get(m, 'off', 'requests_per_s', '{:.2f}')} | "
            f"{get(m, 'apc', 'requests_per_s', '{:.2f}')} | "
            f"{get(m, 'groups', 'requests_per_s', '{:.2f}')} | "
            f"{get(m, 'groups', 'output_tok_per_s', '{:.0f}')} | {ratio(m, 'groups', 'off')} | "
            f"{ratio(m, 'groups', 'apc')} | {any_row['floor_requests_per_s']:.1f} | "
            f"{get(m, 'groups', 'fraction_of_floor', '{:.1%}')} | "
            f"{' / '.join(get(m, k, 'computed_prompt_tokens', '{:,}') for k in MODES)} | "
            f"{get(m, 'groups', 'cascade_rows', '{:,}')} |")
    return out


def write(out: str, meta: dict, rows: list[dict]) -> None:
    meta = dict(meta, title="Shared-prefix throughput (BatchLLM RFC workload and sweep)",
                targets="RFC workload: groups >= 3x off, >= 2x apc shuffled, >= 1.5x apc grouped")
    timed = [dict(r, workload=label(r["workload"], r["degree"], r["prefix_len"]))
             for r in rows if "step_ms" in r]
    steps = (["", "Where a step's time goes (ms per step):", ""]
             + step_table(timed, ["workload", "mode", "order"]) if timed else [])
    write_results(out, meta, rows, table(rows) + steps)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                    help="the engine's quantization, every mode alike: fp8 weights (W8A8) in the "
                         "decoder layers' projections; the floor counts their bytes and FP8 FLOPs")
    ap.add_argument("--workloads", nargs="+", default=["rfc"],
                    help="rfc, sweep, or g<degree>-p<prefix> (e.g. g16-p2000)")
    ap.add_argument("--sweep-degrees", type=int, nargs="+", default=list(SWEEP_DEGREES))
    ap.add_argument("--sweep-prefixes", type=int, nargs="+", default=list(SWEEP_PREFIXES))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--orders", nargs="+", default=list(ORDERS), choices=list(ORDERS))
    ap.add_argument("--num-requests", type=int, default=None,
                    help="requests per workload (default: 6400 for rfc, 1024 or 512 in the sweep)")
    ap.add_argument("--own-len", type=int, default=RFC_OWN,
                    help="own tokens a request (g<degree>-p<prefix> workloads)")
    ap.add_argument("--output-len", type=int, default=RFC_OUT,
                    help="output tokens a request (g<degree>-p<prefix> workloads)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--time-limit-s", type=float, default=420,
                    help="start no run after this many seconds (a GPU call has 600; results "
                         "are written after every run)")
    ap.add_argument("--force-cascade", action="store_true",
                    help="groups mode: every shared block worth a group (ignore the cost rule)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="torch.profiler over this many steps of each run (GPU only)")
    ap.add_argument("--profile-after", type=int, default=300,
                    help="the steps profiled start after this many steps of the run")
    ap.add_argument("--profile-kernels", action="store_true",
                    help="with --profile-steps: every GPU kernel of the window, (name, start us, us), to "
                         "<out>_kernels_<workload>_<mode>_<order>.json")
    ap.add_argument("--step-trace", action="store_true",
                    help="record every step (host phases, GPU time, rows, finishes) to "
                         "<out>_trace_<workload>_<mode>_<order>.json and summarise where the "
                         "GPU idled in the results")
    ap.add_argument("--quick", action="store_true",
                    help="tiny model on CPU, a few requests: a smoke test")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="merge result files into --out instead of running")
    ap.add_argument("--out", default="benchmarks/shared_prefix")
    args = ap.parse_args(argv)
    command = " ".join(["python", "scripts/bench_shared_prefix.py"] + (argv or sys.argv[1:]))

    if args.merge:
        rows, metas = [], []
        for path in args.merge:
            with open(path) as f:
                data = json.load(f)
            metas.append(data["meta"])
            rows += data["results"]
        # Later files replace earlier rows of the same (workload, order, mode).
        keyed = {(r["workload"], r["order"], r["mode"]): r for r in rows}
        write(args.out, dict(metas[-1], command=command,
                             parts=[m["command"] for m in metas]), list(keyed.values()))
        return

    deadline = time.perf_counter() + args.time_limit_s
    if args.quick:
        from scripts.make_tiny_model import make_tiny_model
        model = str(make_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny"), arch="llama", seed=1))
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        args.dtype, args.max_num_seqs, args.max_num_batched_tokens = "float32", 8, 64
        args.force_cascade = True
        workloads = [dict(name="g4-p64", degree=4, prefix=64, own=16, out=4, num_requests=12)]
    else:
        model, cfg = preset_dir(args.preset), PRESETS[args.preset]
        names = []
        for name in args.workloads:
            names += ([f"g{d}-p{p}" for p in args.sweep_prefixes for d in args.sweep_degrees]
                      if name == "sweep" else [name])
        workloads = [parse_workload(n, args.num_requests, args.own_len, args.output_len)
                     for n in names]
    import torch
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    meta = {"hardware": hardware(), "commit": git_commit(), "command": command,
            "settings": {"preset": "tiny-llama" if args.quick else args.preset,
                         "dtype": args.dtype, "quantization": args.quantization,
                         "max_num_seqs": args.max_num_seqs,
                         "max_num_batched_tokens": args.max_num_batched_tokens}}
    rows: list[dict] = []

    def done(row: dict) -> None:        # written as it goes: a call cut off keeps its runs
        rows.append(row)
        write(args.out, meta, rows)
    for mode in args.modes:
        if time.perf_counter() > deadline:
            print(f"time limit: skipping mode {mode}", flush=True)
            continue
        run_mode(mode, workloads, args.orders, args, model, cfg, elem, deadline, done)


if __name__ == "__main__":
    main()
