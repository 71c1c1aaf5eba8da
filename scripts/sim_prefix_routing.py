"""Prefix routing over several engines under a closed loop of clients, on a simulated clock (no
model, no GPU): which balance slack (the prefix_routing_slack setting) keeps groups whole
without leaving one GPU short of work (issue 12, served on two GPUs).

What is real: each engine's Scheduler and KVCacheManager (engine/scheduler.py, with prefix
caching: a prompt whose prefix that engine has computed is served from it), and each instance's
PrefixRouter (engine/prefix_routing.py) over a board held in this process. What is modelled:
- Triton gives a request to an instance whose load (requests it holds) is within one of the
  least loaded (engine/instance_board.py's wait_turn), at random among them;
- a step takes `base_ms + per_row_us * decode rows + per_token_us * prompt tokens`, and
  `eager_ms` more when it carries prompt tokens (it runs eagerly, not as CUDA graphs). The
  defaults fit the H200 at 8B in bf16 with cascade attention (benchmarks/h200/
  open_targets_bounds.md, section 2): a decode step of 512 rows in groups of 16 sharing 2,000
  tokens takes ~19.4 ms, of which ~10.3 the projections, which take about half at 256 rows
  (~10.7 ms a step there); prompt steps ~25 us a token;
- clients: `concurrency` closed-loop streams; prompt i belongs to group i // group_size (a
  shared prefix of `shared` tokens, then `own` tokens of its own). With `--clients k` (as
  bench_serving.py's perf_analyzer processes) client j has c / k of the streams and sends
  prompts j, j + k, ... in turn until the run's prompts are used up, so a client whose
  requests wait on a loaded engine finishes late while the others' streams are done; with 1,
  every stream takes the next prompt. With `--per-stream`, as perf_analyzer runs in
  bench_serving.py (a thread per request in flight, each stepping through its client's
  prompts on its own), stream s of a client with k streams sends the client's prompts s,
  s + k, s + 2k, ...: a group's members then come from streams that drift apart as the run
  goes on, so they reach the server spread out, not together. Only with it did the
  simulation have a new group sent to the least loaded engine lose, as on the GPUs
  (benchmarks/sim_new_prefix_rules.md). `reply_ms` from a step's end to the client hearing
  its tokens, `send_ms` (plus, with `--send-jitter-ms`, an exponential delay of that mean)
  from a client's send to the server's router.

Modes: `routing` (the PrefixRouter with each --slack), `none` (each instance runs its requests
on its own engine), `direct` (whole groups per engine, as bench_serving.py's direct rows).
`out tok/s` is the steady part of the run (from the end of the first wave to the last send);
`run tok/s` the whole run, ramp and drain included, as bench_serving.py's rounds count it (a
GPU left with queued requests when the sends stop drains them alone); `in flight` the
requests out on average from the c-th send to the last (bench_serving.py's "in flight at
full load").

    python scripts/sim_prefix_routing.py --slack 8 32 64 128 100000
"""
from __future__ import annotations

import argparse
import heapq
import os
import random
import statistics
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from engine.instance_board import NUM_SLOTS, PREFIX_TABLE_BITS  # noqa: E402
from engine.kv_cache_manager import KVCacheManager  # noqa: E402
from engine.prefix_routing import PrefixRouter, core_address  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import ModelRunnerOutput, Scheduler  # noqa: E402
from scripts.bench_common import dump_rows  # noqa: E402

BLOCK_SIZE = 16


class SimBoard:
    """The prefix-routing part of engine/instance_board.py's board, in one process: what every
    instance shares, and a view of it per instance (`view(slot)`)."""

    name = "sim-board"

    def __init__(self, num_instances: int) -> None:
        self.num_instances = num_instances
        self.prefix_keys = np.zeros(1 << PREFIX_TABLE_BITS, np.uint64)
        self.prefix_holders = np.zeros(1 << PREFIX_TABLE_BITS, np.uint64)
        self.placed = np.zeros((NUM_SLOTS, NUM_SLOTS), np.int64)
        self.pids = np.zeros(NUM_SLOTS, np.int64)
        self.pids[:num_instances] = np.arange(1, num_instances + 1)

    def view(self, slot: int) -> _BoardView:
        return _BoardView(self, slot)


class _BoardView:
    def __init__(self, board: SimBoard, slot: int) -> None:
        self._board, self.slot, self.name = board, slot, board.name
        self.prefix_keys, self.prefix_holders = board.prefix_keys, board.prefix_holders

    def slot_pids(self) -> np.ndarray:
        return self._board.pids.copy()

    def engine_loads(self) -> np.ndarray:
        return self._board.placed.sum(axis=0)

    def add_placed(self, slot: int, delta: int) -> None:
        self._board.placed[self.slot, slot] += delta


class _Peers:
    """What the router asks of its instance's engine: the other instances' cores, connected."""

    def __init__(self, board: SimBoard, slot: int) -> None:
        self._peers = [core_address(board, int(board.pids[s]), s)
                       for s in range(board.num_instances) if s != slot]

    def peers(self) -> list[str]:
        return self._peers


class SimEngine:
    def __init__(self, num_blocks: int, max_num_seqs: int, budget: int, max_len: int,
                 hold: int = 0) -> None:
        self.sched = Scheduler(KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=True),
                               max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                               max_model_len=max_len, prefill_hold_steps=hold)
        self.busy = False
        self.steps = self.prompt_steps = 0


def prompt_ids(i: int, group_size: int, shared: int, own: int) -> list[int]:
    g = i // group_size
    prefix = np.random.default_rng(g).integers(3, 32000, shared).tolist() if shared else []
    return prefix + np.random.default_rng(10 ** 7 + i).integers(3, 32000, own).tolist()


def simulate(mode: str, slack: int | None, engines: int, c: int, num_requests: int,
             group_size: int, shared: int, own: int, output: int, max_num_seqs: int,
             budget: int, num_blocks: int, base_ms: float, per_row_us: float,
             per_token_us: float, eager_ms: float, send_ms: float, reply_ms: float,
             clients: int = 1, seed: int = 0, hold: int = 0,
             per_stream: bool = False, send_jitter_ms: float = 0.0) -> dict:
    rng = random.Random(seed)
    max_len = shared + own + output + 1
    eng = [SimEngine(num_blocks, max_num_seqs, budget, max_len, hold) for _ in range(engines)]
    board = SimBoard(engines)
    routers = [PrefixRouter(board.view(s), _Peers(board, s), BLOCK_SIZE, max_num_seqs, max_len,
                            slack=slack) for s in range(engines)]
    inst_load = [0] * engines
    params = SamplingParams(max_tokens=output, ignore_eos=True)
    events: list[tuple[float, int, str, int]] = []   # (time, tie-break, kind, engine/request)
    seq = 0
    sent, first, last, where = {}, {}, {}, {}
    # Senders: (the first prompt index, the step to the next). Shared: a client's streams take
    # its prompts in turn (a sender per client); per stream: stream s of a client with k
    # streams sends the client's prompts s, s + k, s + 2k, ... (perf_analyzer, a thread per
    # request in flight, each thread stepping through the input data on its own).
    streams = []
    for k in range(clients):
        if per_stream:
            ck = c // clients + (k < c % clients)           # client k's streams
            streams += [(k + clients * s, clients * ck) for s in range(ck)]
        else:
            streams.append((k, clients))
    next_of = [first for first, _ in streams]       # each sender's next prompt
    stream_of = {}

    def push(at: float, kind: str, x: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, kind, x))

    def send(at: float, stream: int) -> None:
        n = next_of[stream]
        if n < num_requests:
            sent[n], stream_of[n] = at, stream
            jitter = rng.expovariate(1e3 / send_jitter_ms) if send_jitter_ms else 0.0
            push(at + send_ms / 1e3 + jitter, "arrive", n)
            next_of[stream] += streams[stream][1]

    def arrive(at: float, n: int) -> None:
        ids = prompt_ids(n, group_size, shared, own)
        if mode == "direct":
            inst = target = (n // group_size) % engines
        else:
            low = min(inst_load)
            inst = rng.choice([i for i in range(engines) if inst_load[i] <= low + 1])
            target = inst
            if mode == "routing":
                target, _ = routers[inst].choose(np.asarray(ids))
        inst_load[inst] += 1
        routers[inst].placed(target, 1)
        where[n] = (inst, target)
        e = eng[target]
        e.sched.add_request(Request(str(n), ids, params, eos_token_ids=[2]))
        if not e.busy:
            e.busy = True
            push(at, "step", target)

    def step(at: float, k: int) -> None:
        e = eng[k]
        out = e.sched.schedule()
        if out.is_empty:
            e.busy = False
            return
        rows = prompt = 0
        rids, toks = [], []
        for rid, n in out.num_scheduled_tokens.items():
            req = e.sched.requests[rid]
            if req.num_output_tokens:
                rows += n
            else:
                prompt += n
            if req.num_computed_tokens == req.num_tokens:
                rids.append(rid)
                toks.append(5)
        took = (base_ms + per_row_us * rows / 1e3 + per_token_us * prompt / 1e3
                + (eager_ms if prompt else 0.0)) / 1e3
        e.steps += 1
        e.prompt_steps += prompt > 0
        end = at + took
        heard = end + reply_ms / 1e3
        for o in e.sched.update_from_output(out, ModelRunnerOutput(rids, toks)):
            n = int(o.request_id)
            if o.new_token_ids and n not in first:
                first[n] = heard
            if o.finished:
                last[n] = heard
                inst, target = where.pop(n)
                inst_load[inst] -= 1
                routers[inst].placed(target, -1)
                send(heard, stream_of[n])
        push(end, "step", k)

    for i in range(c):
        send(0.0, i if per_stream else i % clients)
    imbalance = []
    while events:
        at, _, kind, x = heapq.heappop(events)
        if kind == "arrive":
            arrive(at, x)
        else:
            step(at, x)
            if x == 0:
                loads = board.placed.sum(axis=0)[:engines]
                imbalance.append(int(loads.max() - loads.min()))
    assert len(last) == num_requests, "requests left unfinished"
    ends = sorted(last.values())
    start, stop = ends[c - 1], max(sent.values())       # after the first wave, to the last send
    sends = sorted(sent.values())
    full0 = sends[c - 1]
    out_s = sum(max(0.0, min(last[n], stop) - max(sent[n], full0)) for n in sent)
    steady = [n for n, t in last.items() if start < t <= stop]
    ttft = sorted(first[n] - sent[n] for n in sent if sent[n] >= start and n in first)
    cached_tokens = sum(e.sched.stats.num_cached_prompt_tokens for e in eng)
    total_prompt = num_requests * (shared + own)
    return {"mode": mode, "slack": routers[0].slack if mode == "routing" else None,
            "max_num_seqs": max_num_seqs, "prefill_hold_steps": hold,
            "output_tok_s": round(len(steady) * output / max(stop - start, 1e-9), 1),
            "run_tok_s": round(num_requests * output / ends[-1], 1),
            "in_flight": round(out_s / max(stop - full0, 1e-9), 1),
            "hit_ratio": round(cached_tokens / total_prompt, 3),
            "ttft_p50_ms": round(1e3 * statistics.median(ttft), 1),
            "ttft_p99_ms": round(1e3 * ttft[int(0.99 * (len(ttft) - 1))], 1),
            "prompt_steps": sum(e.prompt_steps for e in eng),
            "steps": sum(e.steps for e in eng),
            "imbalance_p50": statistics.median(imbalance) if imbalance else 0,
            "imbalance_p90": sorted(imbalance)[int(0.9 * len(imbalance))] if imbalance else 0}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=["direct", "none", "routing"],
                    choices=["direct", "none", "routing"])
    ap.add_argument("--slack", type=int, nargs="+", default=[None],
                    help="prefix_routing_slack values for the routing mode (default: the "
                         "router's, max_num_seqs / 2)")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--waves", type=int, default=10)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--shared", type=int, default=2000)
    ap.add_argument("--own", type=int, default=200)
    ap.add_argument("--output", type=int, default=100)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="per engine (default: the concurrency, as bench_serving.py sets it)")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--num-blocks", type=int, default=40000, help="KV blocks per engine")
    ap.add_argument("--base-ms", type=float, default=2.0)
    ap.add_argument("--per-row-us", type=float, default=34.0)
    ap.add_argument("--per-token-us", type=float, default=24.0)
    ap.add_argument("--eager-ms", type=float, default=2.5,
                    help="more for a step with prompt tokens (~500 kernels launched eagerly)")
    ap.add_argument("--send-ms", type=float, default=1.0)
    ap.add_argument("--reply-ms", type=float, default=1.0)
    ap.add_argument("--clients", type=int, default=1,
                    help="clients sharing the streams, each with its own prompts (as "
                         "bench_serving.py's --clients)")
    ap.add_argument("--per-stream", action="store_true",
                    help="each stream steps through its client's prompts on its own (as "
                         "perf_analyzer does with a thread per request in flight), not the "
                         "client's streams taking them in turn")
    ap.add_argument("--send-jitter-ms", type=float, default=0.0,
                    help="mean of an exponential delay added to each send")
    ap.add_argument("--hold", type=int, nargs="+", default=[0],
                    help="prefill_hold_steps values (the engines' scheduler), each with every mode")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--out", help="also write the rows here (JSON)")
    args = ap.parse_args(argv)
    if args.max_num_seqs is None:
        args.max_num_seqs = args.concurrency
    rows = []
    print("| mode | slack | hold | seed | out tok/s | run tok/s | in flight | hit ratio "
          "| TTFT p50 / p99 ms | prompt steps | steps | load gap p50 | p90 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
          "| ---: |")
    runs = [(m, s, h) for h in args.hold for m in args.modes
            for s in (args.slack if m == "routing" else [None])]
    for mode, slack, hold in runs:
        for seed in args.seeds:
            r = simulate(mode, slack, args.engines, args.concurrency,
                         args.waves * args.concurrency, args.group_size, args.shared, args.own,
                         args.output, args.max_num_seqs, args.budget, args.num_blocks,
                         args.base_ms, args.per_row_us, args.per_token_us, args.eager_ms,
                         args.send_ms, args.reply_ms, args.clients, seed, hold,
                         args.per_stream, args.send_jitter_ms)
            r["seed"] = seed
            rows.append(r)
            shown = '' if r['slack'] is None else r['slack']
            print(f"| {mode} | {shown} | {hold} | {seed} | {r['output_tok_s']} "
                  f"| {r['run_tok_s']} | {r['in_flight']} | {r['hit_ratio']} | {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {r['prompt_steps']} "
                  f"| {r['steps']} | {r['imbalance_p50']} | {r['imbalance_p90']} |", flush=True)
    dump_rows(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
