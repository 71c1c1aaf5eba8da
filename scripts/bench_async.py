"""What the asyncio front end and the core process cost: the same requests through
`AsyncEngine` (core in its own process, binary frames, streaming outputs) and through the
in-process `LLM`, on the same engine settings.

Two workloads: a single stream (ms per output token, seen by the client) and a batch of
concurrent requests (output tokens/s). Target from the design: the served path keeps >= 95% of
the engine's direct throughput.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from bench_common import (add_model_args, git_commit, hardware, model_and_config,
                          write_results)

from engine import LLM, AsyncEngine, SamplingParams


def prompts_for(vocab: int, num: int, length: int) -> list[list[int]]:
    return [[(i * 7919 + j * 104729) % vocab for j in range(length)] for i in range(num)]


def direct(settings: dict, prompts, params) -> tuple[float, float]:
    """(seconds for the batch, ms per token of a lone stream) in process."""
    llm = LLM(**settings)
    llm.generate(prompts[:2], params)                        # warm-up
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    batch_s = time.perf_counter() - t0
    core = llm.core
    core.add_request(core.make_request("lone", prompts[0], params))
    stamps = []
    while core.has_unfinished_requests():
        core.step()
        stamps.append(time.perf_counter())
    core.shutdown()                  # its memory goes back before the served engine sizes its KV
    return batch_s, 1e3 * statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def served(settings: dict, prompts, params) -> tuple[float, float]:
    engine = AsyncEngine(**settings)

    async def one(i, p, stamps=None):
        async for _ in engine.generate(p, params, f"r{i}"):
            if stamps is not None:
                stamps.append(time.perf_counter())

    async def main():
        await asyncio.gather(*(one(f"w{i}", p) for i, p in enumerate(prompts[:2])))
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        batch_s = time.perf_counter() - t0
        stamps: list[float] = []
        await one("lone", prompts[0], stamps)
        return batch_s, 1e3 * statistics.median(b - a for a, b in zip(stamps, stamps[1:]))

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_model_args(ap)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/async_overhead")
    args = ap.parse_args()
    model, cfg = model_and_config(args.preset, args.model)
    vocab = cfg["vocab_size"]
    settings = dict(model=model, load_format="dummy", dtype=args.dtype,
                    kv_cache_dtype=args.kv_cache_dtype, skip_tokenizer_init=True,
                    max_num_seqs=args.num_prompts,
                    max_model_len=args.input_len + args.output_len + 16)
    prompts = prompts_for(vocab, args.num_prompts, args.input_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rows = []
    for name, fn in (("direct LLM (in process)", direct), ("AsyncEngine (core process)", served)):
        batch_s, lone_ms = fn(settings, prompts, params)
        rows.append({"path": name, "batch_seconds": batch_s,
                     "output_tokens_per_s": args.num_prompts * args.output_len / batch_s,
                     "single_stream_ms_per_token": lone_ms})
        print(rows[-1], flush=True)
    ratio = rows[1]["output_tokens_per_s"] / rows[0]["output_tokens_per_s"]
    meta = {"title": f"AsyncEngine vs in-process LLM, {args.model or args.preset} ({args.dtype}, "
                     f"dummy "
                     f"weights), {args.num_prompts} x {args.input_len}/{args.output_len}",
            "hardware": hardware(), "commit": git_commit(),
            "command": " ".join(["python"] + sys.argv), "throughput_ratio": ratio,
            "target": "served >= 95% of direct"}
    table = ["| path | output tok/s | single stream ms/token |", "| :--- | ---: | ---: |"]
    table += [f"| {r['path']} | {r['output_tokens_per_s']:.0f} | "
              f"{r['single_stream_ms_per_token']:.2f} |" for r in rows]
    table += ["", f"AsyncEngine / direct throughput: {100 * ratio:.1f}% (target >= 95%)."]
    write_results(args.out, meta, rows, table)


if __name__ == "__main__":
    main()
