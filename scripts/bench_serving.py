"""What a client of tritonserver gets, beside what the engine gives directly, on the same
prompts and settings.

    python scripts/bench_serving.py                      # GPU: Llama-3.1-8B shape, dummy weights
    python scripts/bench_serving.py --gpus 2             # one llm instance per GPU
    python scripts/bench_serving.py --concurrency 32     # CPU: the tiny model

Three paths, each after a warm-up round that is reported on its own (the first traffic an
engine sees):

  direct    the AsyncEngine in a process of its own per GPU (the core in its own process, as
            in the server), driven by a closed loop of `c` concurrent requests;
  llm       tritonserver with this repository (llm KIND_GPU, one instance per GPU; on CPU the
            repository's KIND_CPU), gRPC streaming, driven by perf_analyzer --streaming;
  llm_bls   the same server, the non-streaming model, driven by perf_analyzer.

Every run sends `waves * c` requests (at least MIN_REQUESTS) of `--prompt-tokens` prompt tokens
(distinct prompts cut from the shipped corpus, new to the engine in every round: none is
answered from the prefix cache; the direct and the served round at a concurrency send the
same ones; with `--shared-prefix-tokens P`, each `--group-size` consecutive prompts start with
the same P-token text, new in every round, as requests that share a system prompt or a
document: the server reports the query rows that read theirs once per group, cascade_rows)
and exactly `--output-tokens` output tokens (ignore_eos; greedy unless `--sampling` says
otherwise), `c` at a time. Output tok/s = requests * output tokens / (last answer -
first send). Per request: TTFT = first response - send; ITL = (last response - first
response) / (output tokens - 1), as genai-perf counts it (a response may carry several tokens);
TTFT also without the first c sends (`ttft_after_first_wave_*`: the opening burst queues for
its prefills all at once: a tenth of the default 10-wave run; with 4 waves, a quarter, and a
run's TTFT p50 at 256 streams moved by up to 1.5x between runs).
llm_bls has one response per request, so its TTFT and ITL are the server's own histograms
(llm_time_to_first_token_seconds, llm_inter_token_latency_seconds; quantiles interpolated
within their buckets). Also recorded: the server's responses and tokens per response, the
serving loop's lag, and Triton's queue time.

Here: the engine settings, the direct engine, the served rounds and the report. The prompts
and which round sends which: scripts/serving_workload.py; the load generators and the client's
figures of a run: scripts/serving_clients.py; what is read from the server and the machine:
scripts/server_probe.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from scripts.bench_common import (PRESETS, git_commit, hardware, preset_dir,  # noqa: E402
                                  sampling_fields, write_results)
from scripts.server_probe import (LoadPoller, children_cpu, cpu_times, cpu_use,  # noqa: E402
                                  scrape, scrape_published, server_side, triton_queue_us)
from scripts.serving_clients import (request_params, run_perf_analyzer, run_py_client,  # noqa: E402
                                     summarize)
from scripts.serving_workload import PromptRounds, make_prompts, num_requests  # noqa: E402

SERVER_START_S = 900.0
TINY_MODEL = os.path.join(ROOT, "models", "tiny-llama")


# ---------------------------------------------------------------------------- settings
def engine_settings(args, on_gpu: bool) -> dict[str, str]:
    """Over the repository's llm parameters (the CPU defaults): these, then --set."""
    settings = {"max_num_seqs": str(max(max(args.concurrency), 16)),
                "max_model_len": str(args.shared_prefix_tokens + args.prompt_tokens
                                     + args.output_tokens + 64)}
    if on_gpu:      # "" keeps the engine's default: KV sized from memory
        settings.update(dtype="bfloat16", num_kv_blocks="", cpu_threads="",
                        max_num_batched_tokens="2048")
    if args.preset:
        settings["load_format"] = "dummy"
    for item in args.set:
        key, _, value = item.partition("=")
        settings[key] = value
    return settings


# ---------------------------------------------------------------------------- direct
def start_delay_s(worker: int, c: int, groups: int, stagger_s: float) -> float:
    """When worker `worker` of `c` starts: the workers form `groups` groups of consecutive
    indices (sizes differing by at most one), the g-th starting g x stagger_s late."""
    return (worker * groups // c) * stagger_s


async def _closed_loop(engine, prompts: list[str], params, c: int, total: int, tag: str,
                       groups: int = 1, stagger_s: float = 0.0):
    """`c` workers send `total` requests back to back (`prompts` holds at least `total`); per
    request (start, first, last, end). With `stagger_s`, the workers form `groups` groups, the
    g-th starting g x stagger_s late (as separate client processes start), each with its
    share of the requests."""
    times: list[tuple[float, float, float, float]] = []
    groups = max(1, min(groups, c)) if stagger_s else 1
    # Each group sends its own share of the requests, as each perf_analyzer process does.
    sizes = [sum(1 for w in range(c) if w * groups // c == g) for g in range(groups)]
    shares = [total * sum(sizes[:g]) // c for g in range(groups + 1)]
    counters = [iter(range(shares[g], shares[g + 1])) for g in range(groups)]

    async def worker(w: int):
        if stagger_s:
            await asyncio.sleep(start_delay_s(w, c, groups, stagger_s))
        for i in counters[w * groups // c]:
            start = time.time()
            first = last = None
            async for out in engine.generate(prompts[i], params, f"{tag}-{i}"):
                if out.outputs[0].token_ids:
                    last = time.time()
                    first = first or last
            times.append((start, first, last, time.time()))
    await asyncio.gather(*(worker(w) for w in range(c)))
    return times


def direct_worker(spec: dict) -> None:
    """One GPU's (or the CPU's) AsyncEngine. Reads commands on stdin ("run C N TAG FIRST
    GROUPS STAGGER_S": c at a time, n requests with prompts FIRST.., or "quit"),
    answers each with a JSON line of per-request times; says "ready" once the engine is up."""
    from engine import AsyncEngine, SamplingParams
    from engine.config import EngineConfig
    config = EngineConfig.from_strings(spec["settings"])
    engine = AsyncEngine(config)
    params = SamplingParams(**request_params(spec["output_tokens"], spec["sampling"]))
    prompts = spec["prompts"]
    print("ready", flush=True)
    loop = asyncio.new_event_loop()
    try:
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            c, n, tag, first = int(cmd[1]), int(cmd[2]), cmd[3], int(cmd[4])
            groups, stagger_s = int(cmd[5]), float(cmd[6])
            before = engine.get_stats()
            times = loop.run_until_complete(
                _closed_loop(engine, prompts[first:first + n], params, c, n, tag, groups,
                             stagger_s))
            after = engine.get_stats()
            print(json.dumps({"times": times, **{
                k: getattr(after, "num_" + k) - getattr(before, "num_" + k)
                for k in ("steps", "graph_steps", "prompt_tokens", "cached_prompt_tokens",
                          "cascade_rows")}}), flush=True)
    finally:
        engine.shutdown()
        loop.close()


class DirectEngines:
    """One direct_worker process per GPU; `run(c, n)` spreads c and n over them at once (over the
    first c of them when c is fewer)."""

    def __init__(self, args, settings: dict, prompts: list[str], gpus: int) -> None:
        self.procs = []
        self.groups, self.stagger_s = args.clients, args.direct_stagger_ms / 1e3
        spec = {"settings": settings, "prompts": prompts, "output_tokens": args.output_tokens,
                "sampling": args.sampling}
        fd, spec_path = tempfile.mkstemp(prefix="bench-serving-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(spec, f)
            for gpu in range(max(gpus, args.cpu_instances)):
                env = dict(os.environ)
                if gpus:
                    env["CUDA_VISIBLE_DEVICES"] = str(gpu)
                self.procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--direct-worker", spec_path],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT))
            for p in self.procs:
                line = p.stdout.readline()
                if line.strip() != "ready":
                    raise RuntimeError(f"direct engine did not start (said {line!r})")
        finally:                            # read by every worker once it is ready
            os.remove(spec_path)

    def run(self, c: int, n: int, tag: str, first: int) -> tuple[list, dict]:
        """Per-request times, and of the engines together: the share of steps that ran as a
        CUDA graph, the query rows that read a shared prefix once per group (cascade_rows) and
        the share of prompt tokens found in the prefix cache (as the server reports them).
        The n requests send prompts first, first + 1, ..."""
        # Fewer concurrent requests than engines: the rest get no work, so c is c streams.
        busy = self.procs[:min(c, len(self.procs))]
        k = len(busy)
        start = first
        for i, p in enumerate(busy):
            ci = c // k + (i < c % k)
            ni = n // k + (i < n % k)
            p.stdin.write(f"run {ci} {max(ni, 1)} {tag} {start} "
                          f"{self.groups} {self.stagger_s}\n")
            start += max(ni, 1)
            p.stdin.flush()
        times, sums = [], {}
        for p in busy:
            answer = json.loads(p.stdout.readline())
            times += answer.pop("times")
            for key, v in answer.items():
                sums[key] = sums.get(key, 0) + v
        stats = {"cascade_rows": sums["cascade_rows"]}
        if sums["steps"]:
            stats["graph_step_fraction"] = round(sums["graph_steps"] / sums["steps"], 3)
        if sums["prompt_tokens"]:
            stats["prefix_cache_hit_ratio"] = round(
                sums["cached_prompt_tokens"] / sums["prompt_tokens"], 3)
        return times, stats

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write("quit\n")
                p.stdin.flush()
            except OSError:
                pass
        for p in self.procs:
            p.wait(timeout=120)


def run_direct(args, settings, prompts, rounds: PromptRounds, gpus, on_row) -> list[dict]:
    """The direct AsyncEngine's rounds; `on_row(row)` as each ends."""
    rows = []
    engines = DirectEngines(args, settings, prompts, gpus)
    try:
        c_max = max(args.concurrency)
        t, steps = engines.run(c_max, num_requests(args, c_max), "warm", rounds.warm())
        rows.append({"path": "direct", "round": "first", "concurrency": c_max,
                     **summarize(*zip(*t), args.output_tokens, c_max), **steps})
        print({k: v for k, v in rows[-1].items() if k != "timeline_ms"}, flush=True)
        on_row(rows[-1])
        for c in args.concurrency:
            cpu0, w0 = cpu_times(), time.monotonic()
            t, steps = engines.run(c, num_requests(args, c), f"c{c}", rounds.direct(c))
            cpu = cpu_use(cpu0, cpu_times(), time.monotonic() - w0)
            rows.append({"path": "direct", "round": "steady", "concurrency": c,
                         **summarize(*zip(*t), args.output_tokens, c), "cpu_cores": cpu,
                         **steps})
            print({k: v for k, v in rows[-1].items() if k != "timeline_ms"}, flush=True)
            on_row(rows[-1])
    finally:
        engines.close()
    return rows


# ---------------------------------------------------------------------------- served
# perf_analyzer 2.51 (and genai-perf, which runs it) asks for every output a config declares
# and records the ones a response leaves out as bytes the server never sent (seen in its
# profile export: cumulative_logprob 1.7e18, -3.1e37, ... where the server sent text_output
# alone). When such FP32 bytes read as NaN or Inf, rapidjson refuses the document and the
# export file is left empty: about one run in twelve of tests/test_bench_serving.py. The
# bench's requests never ask for these outputs, so its copy does not declare them; integer and
# string outputs read the same way are harmless.
PERF_ANALYZER_UNSAFE_OUTPUTS = ("cumulative_logprob",)


def make_repository(repo: str, model_dir: str, settings: dict[str, str], gpus: int,
                    cpu_instances: int = 1) -> dict[str, str]:
    """The repository copy the server runs (llm KIND_GPU with GPUs, else `cpu_instances` of
    it; without the outputs perf_analyzer cannot export, PERF_ANALYZER_UNSAFE_OUTPUTS);
    returns llm's parameters, which the direct engine takes too."""
    from scripts.tritonserver_env import copy_repository
    params = copy_repository(repo, model_dir, settings)
    for model in ("llm", "llm_bls"):
        cfg_path = os.path.join(repo, model, "config.pbtxt")
        with open(cfg_path) as f:
            cfg = f.read()
        for name in PERF_ANALYZER_UNSAFE_OUTPUTS:
            cfg = re.sub(r',?\s*\{\s*name:\s*"%s"[^}]*\}' % name, "", cfg)
        if gpus and model == "llm":
            cfg = cfg.replace("kind: KIND_CPU", "kind: KIND_GPU")
        elif model == "llm" and cpu_instances > 1:
            if "count: 1 kind: KIND_CPU" not in cfg:
                raise SystemExit(f"{cfg_path}: no 'count: 1 kind: KIND_CPU' to give "
                                 f"{cpu_instances} instances")
            cfg = cfg.replace("count: 1 kind: KIND_CPU", f"count: {cpu_instances} kind: KIND_CPU")
        with open(cfg_path, "w") as f:
            f.write(cfg)
    return params


def cpu_list(text: str) -> set[int]:
    """'0-3,8' -> {0, 1, 2, 3, 8}: CPUs this process may run on, and not all of them."""
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed or cpus == allowed:
        raise argparse.ArgumentTypeError(
            f"{text!r}: CPUs to give the clients must be some, not all, of {sorted(allowed)}")
    return cpus


def cpu_text(cpus: set[int]) -> str:
    """{0, 1, 2, 5} -> '0-2,5'."""
    runs, cpus = [], sorted(cpus)
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def run_served(args, repo, prompts, rounds: PromptRounds, gpus, work, on_row) -> list[dict]:
    """The served rounds, each model and driver; `on_row(row)` as each ends."""
    from tests.tritonserver import start_server
    env_before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    rows = []
    server = None
    try:
        # The log goes beside the results from the start: it is there even if this is killed.
        log_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else work
        server_cpus = (os.sched_getaffinity(0) - args.client_cpus if args.client_cpus
                       else None)
        with start_server(repo, extra_args=args.server_arg, timeout_s=SERVER_START_S,
                          log_dir=log_dir, cpus=server_cpus) as server:
            c_max = max(args.concurrency)
            for model in args.models:
                runs = [(c_max, "first", args.drivers[0])] + [
                    (c, "steady", d) for c in args.concurrency for d in args.drivers]
                for c, rnd, driver in runs:
                    if rnd == "first" and model != args.models[0]:
                        continue                # one warm-up round per server
                    n = num_requests(args, c)
                    first = rounds.warm() if rnd == "first" else rounds.served(c)
                    these = prompts[first:first + n]
                    m0, q0 = scrape(server.metrics_url), triton_queue_us(server.metrics_url)
                    cpu0, w0, ch0 = cpu_times(), time.monotonic(), children_cpu()
                    loads = LoadPoller(server.metrics_url)      # the engines' loads
                    loads.start()
                    try:
                        if driver == "python":
                            r = run_py_client(server, model, c, n, these, args.output_tokens,
                                              args.py_clients, args.sampling, args.client_cpus)
                        else:
                            r = run_perf_analyzer(server, model, c, n, these, work,
                                                  args.output_tokens, args.clients, args.sampling,
                                                  args.client_cpus)
                    finally:
                        wall = time.monotonic() - w0
                        loads.stop.set()
                        loads.join()
                    r.update(loads.summary(r.pop("full_load_window", None)))
                    r["cpu_cores"] = cpu_use(cpu0, cpu_times(), wall)
                    r["cpu_cores"]["load generator"] = round((children_cpu() - ch0) / wall, 2)
                    if args.client_cpus:        # where each side ran (the server: as it runs)
                        r["cpus"] = {"server": cpu_text(os.sched_getaffinity(server.pid)),
                                     "clients": cpu_text(args.client_cpus)}
                    m1 = scrape_published(server.metrics_url, m0, r["requests"])
                    q1 = triton_queue_us(server.metrics_url)
                    r.update(server_side(m0, m1))
                    n = q1.get(f"nv_inference_request_success:{model}", 0) - q0.get(
                        f"nv_inference_request_success:{model}", 0)
                    if n:
                        r["triton_queue_ms"] = round((q1[f"nv_inference_queue_duration_us:{model}"]
                                                      - q0[f"nv_inference_queue_duration_us:{model}"])
                                                     / n / 1e3, 3)
                    if model == "llm_bls":      # one response: the server's TTFT / ITL
                        for k in ("ttft", "itl"):
                            h = r.get(f"server_{k}", {})
                            r[f"{k}_p50_ms"], r[f"{k}_p99_ms"] = h.get("p50_ms"), h.get("p99_ms")
                        for q in ("p50", "p99"):    # the client's: its whole request
                            r.pop(f"ttft_after_first_wave_{q}_ms", None)
                    path = model if driver == "perf_analyzer" else f"{model} ({driver} client)"
                    rows.append({"path": path, "round": rnd, "concurrency": c, **r})
                    print({k: v for k, v in rows[-1].items() if k != "timeline_ms"}, flush=True)
                    on_row(rows[-1])
    finally:
        if server is not None and args.out:        # under a name that says what it is
            os.replace(server.log_path, args.out + ".server.log")
        if env_before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = env_before
    return rows


# ---------------------------------------------------------------------------- report
def table(rows: list[dict]) -> list[str]:
    def base(key):
        return {r["concurrency"]: r.get(key) for r in rows
                if r["path"] == "direct" and r["round"] == "steady"}
    direct, direct_full = base("output_tok_s"), base("full_load_tok_s")
    # The gap from a request's end to its slot's next send: the client's slots left idle
    # (serving_clients.reissue_gaps). The engine load gap: with several instances, how far
    # apart their engines' requests ran (server_probe.LoadPoller). The hit ratio: prompt
    # tokens the prefix cache served.
    out = ["| path | round | concurrency | output tok/s (vs direct) | at full load (vs direct) "
           "| in flight at full load | reissue gap p50 / p90 ms | TTFT p50 / p99 ms "
           "| ITL p50 / p99 ms | responses / request | engine load gap p50 / p90 "
           "| prefix hit ratio |",
           "| :--- | :--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def f(v):
        return "-" if v is None else f"{v:.2f}"

    def vs(r, key, ref):
        v, b = r.get(key), ref.get(r["concurrency"])
        if v is None:
            return "-"
        if r["round"] != "steady" or not b:
            return f"{v:.0f}"
        return f"{v:.0f} ({100 * v / b:.1f}%)"
    for r in rows:
        out.append(f"| {r['path']} | {r['round']} | {r['concurrency']} | "
                   f"{vs(r, 'output_tok_s', direct)} | {vs(r, 'full_load_tok_s', direct_full)} | "
                   f"{r.get('full_load_in_flight', '-')} | "
                   f"{f(r.get('reissue_gap_p50_ms'))} / {f(r.get('reissue_gap_p90_ms'))} | "
                   f"{f(r.get('ttft_p50_ms'))} / {f(r.get('ttft_p99_ms'))} | "
                   f"{f(r.get('itl_p50_ms'))} / {f(r.get('itl_p99_ms'))} | "
                   f"{r.get('responses_per_request', '-')} | "
                   f"{r.get('engine_load_gap_p50', '-')} / {r.get('engine_load_gap_p90', '-')} | "
                   f"{r.get('prefix_cache_hit_ratio', '-')} |")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--direct-worker", help=argparse.SUPPRESS)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="a real architecture with dummy weights (default on GPU: llama-3.1-8b)")
    ap.add_argument("--model", help="a local model folder (default on CPU: the tiny model)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs to use, one llm instance each (default: 1 with CUDA, 0 without)")
    ap.add_argument("--cpu-instances", type=int, default=1,
                    help="without GPUs: llm instances on CPU, each with its engine (and as many "
                         "direct engines), as one per GPU")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None,
                    help="default: 1 64 256 on GPU, 32 on CPU")
    ap.add_argument("--prompt-tokens", type=int, default=215)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--shared-prefix-tokens", type=int, default=0,
                    help="each --group-size consecutive prompts start with the same text of "
                         "about this many tokens (a different one per group), before their own "
                         "--prompt-tokens")
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--waves", type=int, default=10, help="requests per run = waves x concurrency")
    ap.add_argument("--models", nargs="+", default=["llm", "llm_bls"],
                    choices=["llm", "llm_bls"])
    ap.add_argument("--reuse-prompts", action="store_true",
                    help="every round sends the warm-up round's prompts (prefills answered "
                         "from the prefix cache: a decode-bound run at the highest token rate)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine setting for both paths (e.g. max_num_seqs=512)")
    ap.add_argument("--clients", type=int, default=1,
                    help="perf_analyzer processes per run, the concurrency shared among them")
    ap.add_argument("--drivers", nargs="+", default=["perf_analyzer"],
                    choices=["perf_analyzer", "python"],
                    help="load generators for the served runs: perf_analyzer (C++) and/or a "
                         "closed loop of tritonclient.grpc.aio streams (tells the client's "
                         "gaps from the server's)")
    ap.add_argument("--py-clients", type=int, default=4,
                    help="processes for the python driver, the concurrency shared among them")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="an extra tritonserver flag (e.g. --server-arg=--log-verbose=1)")
    ap.add_argument("--direct-stagger-ms", type=float, default=0.0,
                    help="the direct engine's closed loop starts as --clients groups, each this "
                         "much after the last (as perf_analyzer's processes do; default: all at "
                         "once)")
    ap.add_argument("--sampling", type=sampling_fields, default={}, metavar="JSON",
                    help='SamplingParams fields for every request of both paths, over greedy '
                         '(e.g. \'{"temperature": 0.8, "top_p": 0.95}\'); max_tokens and '
                         'ignore_eos come from --output-tokens')
    ap.add_argument("--client-cpus", type=cpu_list, default=None, metavar="LIST",
                    help="served runs: the load generators run on these CPUs (e.g. 24-31) and "
                         "the server on the others, as if the clients were on another host")
    ap.add_argument("--skip-direct", action="store_true")
    ap.add_argument("--skip-served", action="store_true")
    ap.add_argument("--out", default=None, help="results prefix (.json and .md)")
    args = ap.parse_args(argv)
    if args.group_size < 1 or args.shared_prefix_tokens < 0:
        ap.error("--group-size must be >= 1 and --shared-prefix-tokens >= 0")
    if args.direct_worker:
        with open(args.direct_worker) as f:
            direct_worker(json.load(f))
        return {}

    import torch
    on_gpu = torch.cuda.is_available()
    gpus = args.gpus if args.gpus is not None else (1 if on_gpu else 0)
    if gpus and not on_gpu:
        raise SystemExit("--gpus needs CUDA")
    if args.cpu_instances < 1 or gpus and args.cpu_instances > 1:
        raise SystemExit("--cpu-instances must be at least 1, and 1 with GPUs")
    if args.model is None and args.preset is None and on_gpu:
        args.preset = "llama-3.1-8b"
    if args.preset:
        model_dir = preset_dir(args.preset, tokenizer=True)
    else:
        model_dir = os.path.abspath(args.model or TINY_MODEL)
        if not os.path.isdir(model_dir):
            from scripts.make_tiny_model import make_tiny_model
            make_tiny_model(model_dir)
    args.concurrency = args.concurrency or ([1, 64, 256] if on_gpu else [32])
    work = tempfile.mkdtemp(prefix="bench-serving-")
    repo = os.path.join(work, "repo")
    settings = make_repository(repo, model_dir, engine_settings(args, on_gpu), gpus,
                               args.cpu_instances)
    rounds = PromptRounds(args)
    prompts = make_prompts(model_dir, rounds.total, args.prompt_tokens,
                           args.shared_prefix_tokens, args.group_size)
    name = args.preset or os.path.basename(model_dir)
    where = f"{gpus} GPU(s)" if gpus else f"no GPU, {args.cpu_instances} CPU instance(s)"
    meta = {"title": f"Served vs direct: {name}, {where}, "
                     + (f"{args.shared_prefix_tokens} shared (groups of {args.group_size}) + "
                        if args.shared_prefix_tokens else "")
                     + f"{args.prompt_tokens} prompt / {args.output_tokens} output tokens",
            "hardware": hardware(), "commit": git_commit(),
            "command": " ".join(["python"] + [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
            "settings": {k: v for k, v in settings.items() if k != "model"},
            "gpus": gpus, "cpu_instances": args.cpu_instances, "reuse_prompts": args.reuse_prompts,
            "shared_prefix_tokens": args.shared_prefix_tokens, "group_size": args.group_size,
            "sampling": request_params(args.output_tokens, args.sampling), "targets": "c=256: llm >= 90% of direct, llm_bls >= 85%, served TTFT "
                                     "p50 <= 1.2x direct; c=1: ms/token within 3%"}
    rows: list[dict] = []

    def on_row(row: dict) -> None:      # saved as it comes: a run cut off keeps its rounds
        rows.append(row)
        if args.out:
            write_results(args.out, meta, rows, table(rows), echo=False)

    if not args.skip_direct:
        run_direct(args, settings, prompts, rounds, gpus, on_row)
    if not args.skip_served:
        run_served(args, repo, prompts, rounds, gpus, work, on_row)
    if args.out:
        write_results(args.out, meta, rows, table(rows))
    else:
        print("\n".join(table(rows)))
    shutil.rmtree(work, ignore_errors=True)
    return {"meta": meta, "results": rows}


if __name__ == "__main__":
    main()
