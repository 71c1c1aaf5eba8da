"""Host time an offline job spends on its prompts before the first step: `LLM.generate` checks
every prompt's token ids (engine.llm.encode_prompt) and finds the shared prefixes
(engine.prefix_groups.group_prompts) before it schedules anything, so the GPU waits for both.
No model is loaded; the prompts have issue 12's RFC shape (groups sharing a prefix, each member
with its own tail, shuffled).

    python3 scripts/bench_prompt_intake.py --out benchmarks/prompt_intake
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.llm import encode_prompt  # noqa: E402
from engine.prefix_groups import group_prompts  # noqa: E402
from scripts.bench_common import git_commit, hardware, write_results  # noqa: E402


def rfc_prompts(num_requests: int, degree: int, prefix_len: int, own_len: int, vocab: int = 128000,
                seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(-(-num_requests // degree))]
    prompts = [prefixes[i // degree] + [rng.randrange(vocab) for _ in range(own_len)]
               for i in range(num_requests)]
    rng.shuffle(prompts)
    return prompts


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=6400)
    ap.add_argument("--degree", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--own-len", type=int, default=200)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True, help="results prefix (.json and .md)")
    args = ap.parse_args()
    prompts = rfc_prompts(args.num_requests, args.degree, args.prefix_len, args.own_len)
    encode_s = median_s(lambda: [encode_prompt(None, p) for p in prompts], args.repeats)
    group_s = median_s(lambda: group_prompts(prompts, args.block_size), args.repeats)
    row = {"num_requests": args.num_requests, "degree": args.degree, "prefix_len": args.prefix_len,
           "own_len": args.own_len, "token_ids": sum(map(len, prompts)), "encode_prompt_s": encode_s,
           "group_prompts_s": group_s}
    meta = {"title": "Host time on an offline job's prompts before its first step",
            "hardware": hardware(), "commit": git_commit(), "command": " ".join(["python3"] + sys.argv)}
    table = ["| requests | token ids | encode_prompt s | group_prompts s |", "| ---: | ---: | ---: | ---: |",
             f"| {args.num_requests} | {row['token_ids']:,} | {encode_s:.3f} | {group_s:.3f} |"]
    write_results(args.out, meta, [row], table)


if __name__ == "__main__":
    main()
