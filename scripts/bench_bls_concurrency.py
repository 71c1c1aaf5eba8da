"""N concurrent non-streaming `llm_bls` requests against one: batched, or queued?

Through a real tritonserver serving a copy of model_repository (the shipped settings, the
tiny CPU model unless `--model` says otherwise), gRPC `ModelInfer` to `llm_bls`:

  one  a single greedy request of `--max-tokens` tokens (ignore_eos), timed end to end;
  N    `--concurrency` such requests sent at once from as many threads, each with its own
       gRPC channel, connected before the clock starts; timed until the last answer.

Each round takes the best of `--best-of` runs of each (other processes on a small machine
only ever add time) and reports N / one. Served one after another, N requests would take
~N times one; batched, the target is < 2x (issue 3). For reference the same ratio is measured
on the engine alone (`LLM.generate`, in this process, after the server has stopped): what the
serving path adds is the difference.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import tritonclient.grpc as grpcclient  # noqa: E402

from scripts.bench_common import git_commit, write_results  # noqa: E402
from scripts.bench_loop_lag import grpc_inputs, make_repo  # noqa: E402
from scripts.server_probe import cpu_name  # noqa: E402
from tests.tritonserver import start_server  # noqa: E402

TARGET_RATIO = 2.0
WORDS = ["ships", "clouds", "bread", "rivers", "lamps", "maps", "salt", "bees"]


def prompts(n: int) -> list[str]:
    return [f"Request {i}: a few words about {WORDS[i % len(WORDS)]}." for i in range(n)]


def greedy(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def time_concurrent(grpc_url: str, n: int, params: dict) -> float:
    """Seconds for `n` llm_bls requests sent at once to all be answered. Channels, inputs and
    threads are made before the clock starts: what is timed is the server, not the client's
    set-up. Raises if any request fails."""
    clients = [grpcclient.InferenceServerClient(grpc_url) for _ in range(n)]
    inputs = [grpc_inputs(p, params, stream=False, exclude_input_in_output=True)
              for p in prompts(n)]
    try:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda c: c.is_server_live(), clients))      # connect
            t0 = time.monotonic()
            results = list(pool.map(lambda ci: ci[0].infer("llm_bls", ci[1]),
                                    zip(clients, inputs)))
            elapsed = time.monotonic() - t0
    finally:
        for c in clients:
            c.close()
    for r in results:
        if len(r.as_numpy("text_output")[0]) == 0:
            raise RuntimeError("llm_bls answered with no text")
    return elapsed


def best_ratio(timed: Callable[[int], float], n: int, best_of: int) -> dict:
    """Best of `best_of` runs of one request and of `n` at once, the two taken in turn (a
    passing burst of other work on the machine then slows both, not one side's every run)."""
    ones, manys = [], []
    for _ in range(best_of):
        ones.append(timed(1))
        manys.append(timed(n))
    one, many = min(ones), min(manys)
    return {"one_s": round(one, 4), "n_s": round(many, 4), "ratio": round(many / one, 3)}


def concurrency_ratio(grpc_url: str, n: int, params: dict, best_of: int) -> dict:
    """One round through the server."""
    return best_ratio(lambda k: time_concurrent(grpc_url, k, params), n, best_of)


def engine_ratio(model: str, settings: dict[str, str], n: int, max_tokens: int,
                 best_of: int) -> dict:
    """The same ratio on the engine alone, in this process, with the served settings."""
    from engine import LLM, SamplingParams
    from engine.config import EngineConfig

    config = EngineConfig.from_strings({**settings, "model": model})
    llm = LLM(**{name: getattr(config, name) for name in EngineConfig.field_names()})
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts(1), sp)                                   # warm-up

    def timed(k: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts(k), sp)
        return time.perf_counter() - t0
    try:
        return best_ratio(timed, n, best_of)
    finally:
        llm.core.shutdown()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--best-of", type=int, default=5)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "tiny-llama"))
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks"))
    args = ap.parse_args(argv)
    if not os.path.isdir(args.model):
        from scripts.make_tiny_model import make_tiny_model
        make_tiny_model(args.model)
    params = greedy(args.max_tokens)
    load_start = os.getloadavg()[0]
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-bls-") as work:
        repo = os.path.join(work, "repo")
        settings = make_repo(repo, args.model, {})
        with start_server(repo, log_dir=os.path.join(work, "log")) as server:
            time_concurrent(server.grpc_url, 1, params)              # warm-up
            time_concurrent(server.grpc_url, args.concurrency, params)
            rounds = [concurrency_ratio(server.grpc_url, args.concurrency, params, args.best_of)
                      for _ in range(args.rounds)]
    engine = engine_ratio(args.model, settings, args.concurrency, args.max_tokens,
                          args.best_of)
    ratios = [r["ratio"] for r in rounds]
    summary = {"median": statistics.median(ratios), "max": max(ratios), "min": min(ratios),
               "rounds_within_target": sum(r < TARGET_RATIO for r in ratios)}
    meta = {
        "title": f"{args.concurrency} concurrent llm_bls requests vs one",
        "command": "python scripts/bench_bls_concurrency.py "
                   + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": git_commit(), "date": datetime.date.today().isoformat(),
        "cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
        "hardware": f"{cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}"
                    f", load average {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end",
        "target": f"{args.concurrency} at once < {TARGET_RATIO}x one",
        "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "best_of": args.best_of, "llm_settings": settings, "engine_alone": engine,
        "summary": summary, "seconds": round(time.monotonic() - t_start, 1),
    }
    table = [
        f"{args.concurrency} greedy requests of {args.max_tokens} tokens (ignore_eos) sent at "
        f"once to `llm_bls` over gRPC ModelInfer, against one; each round is the best of "
        f"{args.best_of} runs of each. `llm` settings: the shipped config.pbtxt "
        f"({', '.join(f'{k}={v}' for k, v in settings.items() if k != 'model')}), model "
        f"`{os.path.relpath(args.model, ROOT)}`. Client, server and engine core share the "
        f"machine.", "",
        f"- Through tritonserver, {args.rounds} rounds: ratio median {summary['median']:.2f}x, "
        f"max {summary['max']:.2f}x, min {summary['min']:.2f}x; "
        f"{summary['rounds_within_target']} of {args.rounds} rounds < {TARGET_RATIO}x.",
        f"- The engine alone (`LLM.generate`, same settings, best of {args.best_of}): one "
        f"{engine['one_s']:.3f} s, {args.concurrency} {engine['n_s']:.3f} s, ratio "
        f"{engine['ratio']:.2f}x.", "",
        "| round | one s | N at once s | ratio | target < 2x |",
        "| ---: | ---: | ---: | ---: | :---: |",
    ] + [f"| {i + 1} | {r['one_s']:.3f} | {r['n_s']:.3f} | {r['ratio']:.2f} | "
         f"{'ok' if r['ratio'] < TARGET_RATIO else 'FAIL'} |" for i, r in enumerate(rounds)]
    write_results(os.path.join(args.out_dir, "bls_concurrency"), meta, rounds, table)
    return {"meta": meta, "results": rounds}


if __name__ == "__main__":
    main()
