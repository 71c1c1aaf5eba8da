"""Where a prefix no engine holds (a group's first member) should run, in the routing
simulation (scripts/sim_prefix_routing.py): the RFC-like served workload of
benchmarks/h200x2/served_shared_prefix.md (two engines, 512 streams from 8 clients, groups of
16 sharing 2,000 tokens, 200 own, 100 out), under each client order and send jitter.

Rules: `direct` (whole groups per engine, no router); `old` (where Triton put it: the
committed router with its turn switched off); `least` (the least loaded engine: 8a6aff1's
router, tried on the GPUs and reverted); `turns` (the committed router: the engines in turn
once most prompts follow a held prefix).

    python benchmarks/sim_new_prefix_rules.py --out benchmarks/sim_new_prefix_rules.json
    python benchmarks/sim_new_prefix_rules.py --orders per-stream --jitters 10 --slacks 64 128 256 1000000
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import engine.prefix_routing as routing  # noqa: E402
from scripts import sim_prefix_routing as sim  # noqa: E402

WORKLOAD = dict(engines=2, c=512, num_requests=5120, group_size=16, shared=2000, own=200,
                output=100, max_num_seqs=512, budget=2048, num_blocks=40000, base_ms=2.0,
                per_row_us=34.0, per_token_us=24.0, eager_ms=2.5, send_ms=1.0, reply_ms=1.0,
                clients=8)


def least_loaded_router():
    """8a6aff1's PrefixRouter (a new prefix to the least loaded engine)."""
    text = subprocess.run(["git", "show", "8a6aff1:engine/prefix_routing.py"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("prefix_routing_8a6aff1", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    os.unlink(f.name)
    return module.PrefixRouter


def run(rule: str, per_stream: bool, jitter: float, seed: int, least,
        slack: int | None = None) -> dict:
    committed, gate = sim.PrefixRouter, routing.FOLLOW_RATE_FOR_TURNS
    try:
        if rule == "old":
            routing.FOLLOW_RATE_FOR_TURNS = 2.0         # never reached: no turns
        if rule == "least":
            sim.PrefixRouter = least
        r = sim.simulate("direct" if rule == "direct" else "routing", slack,
                         per_stream=per_stream, send_jitter_ms=jitter, seed=seed, **WORKLOAD)
    finally:
        sim.PrefixRouter, routing.FOLLOW_RATE_FOR_TURNS = committed, gate
    return {"rule": rule, "order": "per-stream" if per_stream else "shared",
            "send_jitter_ms": jitter, "seed": seed, **r}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--orders", nargs="+", default=["shared", "per-stream"])
    ap.add_argument("--jitters", type=float, nargs="+", default=[0.0, 10.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--slacks", type=int, nargs="+",
                    help="instead: the committed rule (turns) at each prefix_routing_slack")
    ap.add_argument("--out")
    args = ap.parse_args()
    least = least_loaded_router()
    # Each (rule, slack) at each order, jitter and seed; `of direct` where direct ran beside.
    variants = ([("turns", slack) for slack in args.slacks] if args.slacks else
                [(rule, None) for rule in ("direct", "old", "least", "turns")])
    rows = []
    print("| order | jitter ms | seed | rule | slack | out tok/s | run tok/s | of direct "
          "| in flight | hit ratio | TTFT p50 ms | load gap p50 / p90 |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for order in args.orders:
        for jitter in args.jitters:
            for seed in args.seeds:
                direct = None
                for rule, slack in variants:
                    r = run(rule, order == "per-stream", jitter, seed, least, slack)
                    direct = r["output_tok_s"] if rule == "direct" else direct
                    rows.append(r)
                    share = f"{100 * r['output_tok_s'] / direct:.1f}%" if direct else "-"
                    print(f"| {order} | {jitter:g} | {seed} | {rule} | {r['slack'] or ''} "
                          f"| {r['output_tok_s']:,.0f} | {r['run_tok_s']:,.0f} | {share} "
                          f"| {r['in_flight']} | {r['hit_ratio']} | {r['ttft_p50_ms']} "
                          f"| {r['imbalance_p50']} / {r['imbalance_p90']} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
