"""The engine's scheduler under a closed loop of clients, on a simulated clock (no model, no GPU):
how the time to first token depends on how long a client takes to send its next request and to
hear its tokens (issue 11: served TTFT p50 1.2-1.5x the direct engine's at the same throughput).

The real Scheduler (engine/scheduler.py) plans every step; a step takes
`base_ms + per_token_us * tokens` of simulated time (tokens = decode rows + prompt tokens; the
H200 at 8B: ~13 ms for 256 decode rows, ~51 ms for a 2048-token step). With `--async-lag 2` a
request that arrives while step k runs is planned into step k + 2, as with async scheduling
(step k + 1 was planned when step k was launched); 1: into step k + 1. Each of `c` clients sends
a request of `--prompt` tokens for `--output` tokens; `--reply-ms` after a step ends its tokens
reach the client, and `--send-ms` after a client hears its last token its next request reaches
the scheduler. TTFT = first token heard - request sent, after the first wave.

    python scripts/sim_closed_loop.py --send-ms 1 15 --reply-ms 0 5
"""
from __future__ import annotations

import argparse
import heapq
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from engine.kv_cache_manager import KVCacheManager  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import ModelRunnerOutput, Scheduler  # noqa: E402
from scripts.bench_common import dump_rows  # noqa: E402


def simulate(c: int, prompt: int, output: int, num_requests: int, send_ms: float, reply_ms: float,
             base_ms: float, per_token_us: float, budget: int, async_lag: int,
             block_size: int = 16) -> dict:
    max_len = prompt + output + 1
    blocks = (c + 8) * (-(-max_len // block_size)) + 64
    sched = Scheduler(KVCacheManager(blocks, block_size, enable_caching=False), max_num_seqs=c,
                      max_num_batched_tokens=budget, max_model_len=max_len)
    params = SamplingParams(max_tokens=output, ignore_eos=True)
    arrivals: list[tuple[float, int]] = []      # (time the scheduler can see it, request number)
    sent: dict[int, float] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    next_id = 0

    def send(at: float) -> None:
        nonlocal next_id
        if next_id < num_requests:
            sent[next_id] = at
            heapq.heappush(arrivals, (at + send_ms / 1e3, next_id))
            next_id += 1

    for _ in range(c):
        send(0.0)
    t = 0.0
    step_starts: list[float] = []            # when each step was launched
    steps = 0
    idle = True                              # no step in flight: the engine plans on arrival
    while len(last) < num_requests:
        # Requests the scheduler sees when it plans this step: with async scheduling it was
        # planned when the step before was launched.
        seen_by = t if idle or async_lag == 1 else step_starts[-1]
        while arrivals and arrivals[0][0] <= seen_by:
            _, rid = heapq.heappop(arrivals)
            sched.add_request(Request(str(rid), [3 + (rid * 7 + i) % 1000 for i in range(prompt)],
                                      params, eos_token_ids=[2]))
        out = sched.schedule()
        if out.is_empty:
            assert arrivals, "nothing to run and nothing coming"
            t, idle = max(t, arrivals[0][0]), True
            continue
        idle = False
        step_starts.append(t)
        t += (base_ms + per_token_us * out.total_num_scheduled_tokens / 1e3) / 1e3
        steps += 1
        rids, toks = [], []
        for rid in out.num_scheduled_tokens:
            req = sched.requests[rid]
            if req.num_computed_tokens == req.num_tokens:
                rids.append(rid)
                toks.append(5)
        heard = t + reply_ms / 1e3
        for o in sched.update_from_output(out, ModelRunnerOutput(rids, toks)):
            n = int(o.request_id)
            if o.new_token_ids and n not in first:
                first[n] = heard
            if o.finished:
                last[n] = heard
                send(heard)
    later = sorted(sent)[c:]
    ttft = [1e3 * (first[n] - sent[n]) for n in later]
    itl = [1e3 * (last[n] - first[n]) / max(output - 1, 1) for n in later]
    span = max(last.values())
    return {"send_ms": send_ms, "reply_ms": reply_ms, "async_lag": async_lag, "steps": steps,
            "output_tok_s": round(num_requests * output / span, 1),
            "ttft_p50_ms": round(statistics.median(ttft), 1),
            "ttft_mean_ms": round(statistics.fmean(ttft), 1),
            "itl_p50_ms": round(statistics.median(itl), 2)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=215)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--waves", type=int, default=8)
    ap.add_argument("--send-ms", type=float, nargs="+", default=[1.0, 15.0])
    ap.add_argument("--reply-ms", type=float, nargs="+", default=[0.0, 5.0])
    ap.add_argument("--async-lag", type=int, nargs="+", default=[2], choices=[1, 2])
    ap.add_argument("--base-ms", type=float, default=8.0)
    ap.add_argument("--per-token-us", type=float, default=21.0)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--out", help="also write the rows here (JSON)")
    args = ap.parse_args(argv)
    rows = []
    print("| async lag | send ms | reply ms | steps | output tok/s | TTFT p50 ms | TTFT mean ms | ITL p50 ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for lag in args.async_lag:
        for send_ms in args.send_ms:
            for reply_ms in args.reply_ms:
                r = simulate(args.concurrency, args.prompt, args.output,
                             args.waves * args.concurrency, send_ms, reply_ms, args.base_ms,
                             args.per_token_us, args.budget, lag)
                rows.append(r)
                print(f"| {lag} | {send_ms:g} | {reply_ms:g} | {r['steps']} | {r['output_tok_s']} | "
                      f"{r['ttft_p50_ms']} | {r['ttft_mean_ms']} | {r['itl_p50_ms']} |", flush=True)
    dump_rows(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
