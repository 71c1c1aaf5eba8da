"""Triton paged attention on the GPU at Llama-3.1-8B shapes (Hq 32, Hkv 8, D 128, block 16, bf16).

1. Correctness against `paged_attention_ref` (fp32 math) on decode batches (context 1k/8k/32k,
   batch 1/16/64), prefill chunks of 512 and 2048 tokens, mixed batches, a sliding window, forced
   splits and a CUDA-graph replay.
2. Timing (CUDA events, L2 flushed before each run, median of --iters after --warmup) beside
   torch's scaled_dot_product_attention on the same data laid out contiguously: decode in GB/s
   (K and V read once + q + out) against the H200's 4.8 TB/s, prefill in TFLOP/s (causal pairs
   only, 4 * D FLOP each).
3. With --sweep: split counts and tile configs, to choose the defaults (--sweep-kinds: decode,
   prefill; prefill configs each with and without loading K/V a step ahead).

Prints a table and writes JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels.paged_attention as pa  # noqa: E402
from kernels.paged_attention import paged_attention, paged_attention_ref  # noqa: E402
from scripts.bench_common import capture_graph  # noqa: E402

HQ, HKV, D, BLOCK = 32, 8, 128, 16
HBM_BYTES_PER_S = 4.8e12
DTYPE = torch.bfloat16
ATOL, RTOL = 1.5e-2, 1e-2
DEVICE = "cuda"


class Pool:
    """One big paged cache; each batch takes scattered blocks from it."""

    def __init__(self, num_tokens: int, seed: int = 0):
        torch.manual_seed(seed)
        self.num_blocks = triton.cdiv(num_tokens, BLOCK) + 64
        self.k = torch.randn(self.num_blocks, BLOCK, HKV, D, device=DEVICE, dtype=DTYPE)
        self.v = torch.randn(self.num_blocks, BLOCK, HKV, D, device=DEVICE, dtype=DTYPE)

    def batch(self, q_lens: list[int], ctx_lens: list[int]) -> tuple:
        need = [triton.cdiv(n, BLOCK) for n in ctx_lens]
        ids = torch.randperm(self.num_blocks, device=DEVICE)[:sum(need)].to(torch.int32)
        table = torch.zeros(len(ctx_lens), max(need), dtype=torch.int32, device=DEVICE)
        off = 0
        for b, n in enumerate(need):
            table[b, :n] = ids[off:off + n]
            off += n
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
        q = torch.randn(int(cu[-1]), HQ, D, device=DEVICE, dtype=DTYPE)
        return (q, self.k, self.v, table, cu.to(DEVICE), torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE))


def run(args, q_lens, ctx_lens, window=None, splits=None):
    return paged_attention(*args, D ** -0.5, window, max_seqlen_q=max(q_lens),
                           max_seqlen_k=max(ctx_lens), num_kv_splits=splits)


def errors(got, ref) -> dict:
    diff = (got.float() - ref.float()).abs()
    bad = diff > ATOL + RTOL * ref.float().abs()
    return {"max_abs_err": diff.max().item(), "mean_abs_err": diff.mean().item(),
            "num_bad": int(bad.sum()), "ok": not bool(bad.any()) and not bool(got.isnan().any())}


_gpu_sleep = getattr(torch.cuda, "_sleep", lambda cycles: None)


def bench_ms(fn, warmup: int, iters: int, flush: torch.Tensor) -> float:
    for _ in range(warmup):
        fn()
    events = []
    for _ in range(iters):
        flush.zero_()                        # evict the 60 MB L2 so reads come from HBM
        # Keep the GPU busy ~100 us more so the host's launch cost of fn (Python checks, two
        # Triton launches) is not counted for kernels of a few microseconds.
        _gpu_sleep(200_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def contiguous_kv(args, ctx_len):
    """[B, Hkv, L, D] copies of the paged K/V of a batch whose sequences all have ctx_len."""
    _, k_cache, v_cache, table, _, _ = args
    blocks = table[:, :ctx_len // BLOCK].long()
    k = k_cache[blocks].flatten(1, 2).transpose(1, 2).contiguous()
    v = v_cache[blocks].flatten(1, 2).transpose(1, 2).contiguous()
    return k, v


def sdpa_ms(q4, k, v, causal, warmup, iters, flush):
    """Best of SDPA with native GQA and with K/V expanded to Hq heads beforehand."""
    best = {}
    try:
        best["gqa"] = bench_ms(lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=causal, enable_gqa=True),
                               warmup, iters, flush)
    except RuntimeError as e:                # noqa: PERF203
        print(f"  sdpa enable_gqa failed: {e}")
    ke, ve = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    best["expanded"] = bench_ms(lambda: F.scaled_dot_product_attention(q4, ke, ve, is_causal=causal),
                                warmup, iters, flush)
    del ke, ve
    kind = min(best, key=best.get)
    return best[kind], kind


def check_correctness(pool: Pool, gen: torch.Generator) -> list[dict]:
    rows = []

    def case(name, q_lens, ctx_lens, window=None, splits=None):
        args = pool.batch(q_lens, ctx_lens)
        got = run(args, q_lens, ctx_lens, window, splits)
        ref = paged_attention_ref(*args, D ** -0.5, window)
        rows.append({"case": name, "window": window, "splits": splits, **errors(got, ref)})
        print(f"  {name:<44} max|err| {rows[-1]['max_abs_err']:.3e}  {'ok' if rows[-1]['ok'] else 'FAIL'}")

    rand = lambda lo, hi, n: torch.randint(lo, hi + 1, (n,), generator=gen).tolist()  # noqa: E731
    for ctx in (1024, 8192, 32768):
        for batch in (1, 16, 64):
            lens = rand(1, ctx, batch - 1) + [ctx]
            case(f"decode ctx<={ctx} B={batch}", [1] * batch, lens)
    case("prefill 512 fresh x4", [512] * 4, [512] * 4)
    case("prefill chunk 2048 after 2048 cached x2", [2048] * 2, [4096] * 2)
    mixed_q = [2048, 512] + [1] * 62
    mixed_ctx = [6144, 512] + rand(1, 8192, 62)
    case("mixed: 2048 chunk + 512 prompt + 62 decodes", mixed_q, mixed_ctx)
    case("mixed, sliding window 4096", mixed_q, mixed_ctx, window=4096)
    case("mixed, forced 4 splits", mixed_q, mixed_ctx, splits=4)
    case("decode B=16 ctx<=32k, window 4096, 8 splits", [1] * 16, rand(1, 32768, 16), window=4096, splits=8)

    # CUDA graph: capture once, write new lengths in place, replay.
    q_lens, lens = [1] * 16, rand(1, 8000, 16)
    args = pool.batch(q_lens, [8192] * 16)
    args[5].copy_(torch.tensor(lens, dtype=torch.int32))
    call = lambda: paged_attention(*args, D ** -0.5, max_seqlen_q=1, max_seqlen_k=8192)  # noqa: E731
    graph, out = capture_graph(call)
    args[5].add_(100)
    graph.replay()
    torch.cuda.synchronize()
    rows.append({"case": "cuda graph replay, lengths changed in place",
                 **errors(out, paged_attention_ref(*args, D ** -0.5))})
    print(f"  {rows[-1]['case']:<44} max|err| {rows[-1]['max_abs_err']:.3e}  {'ok' if rows[-1]['ok'] else 'FAIL'}")
    return rows


def time_decode(pool, warmup, iters, flush) -> list[dict]:
    rows = []
    for ctx in (1024, 8192, 32768):
        for batch in (1, 16, 64):
            q_lens, lens = [1] * batch, [ctx] * batch
            args = pool.batch(q_lens, lens)
            splits = pa.choose_num_kv_splits(batch, HKV, ctx, pa._num_sms(args[0].device))
            ms = bench_ms(lambda: run(args, q_lens, lens), warmup, iters, flush)
            k, v = contiguous_kv(args, ctx)
            q4 = args[0].view(batch, 1, HQ, D).transpose(1, 2)
            ref_ms, kind = sdpa_ms(q4, k, v, False, warmup, iters, flush)
            del k, v
            nbytes = 2 * batch * ctx * HKV * D * 2 + 2 * batch * HQ * D * 2
            row = {"ctx": ctx, "batch": batch, "splits": splits, "ms": ms, "GB_s": nbytes / ms / 1e6,
                   "hbm_pct": 100 * nbytes / ms / 1e-3 / HBM_BYTES_PER_S, "sdpa_ms": ref_ms,
                   "sdpa_kind": kind, "sdpa_GB_s": nbytes / ref_ms / 1e6}
            rows.append(row)
            print(f"  decode ctx {ctx:>6} B {batch:>3} S {splits:>2}: {ms * 1e3:8.1f} us "
                  f"{row['GB_s']:7.0f} GB/s ({row['hbm_pct']:4.1f}% HBM) | sdpa[{kind}] "
                  f"{ref_ms * 1e3:8.1f} us {row['sdpa_GB_s']:7.0f} GB/s")
    return rows


def causal_pairs(q_lens, ctx_lens, window=None):
    total = 0
    for n, L in zip(q_lens, ctx_lens):
        for p in range(L - n, L):
            total += p + 1 if window is None else min(p + 1, window)
    return total


def time_prefill(pool, warmup, iters, flush) -> list[dict]:
    rows = []
    cases = [("fresh 512 x8", [512] * 8, [512] * 8), ("fresh 2048 x2", [2048] * 2, [2048] * 2),
             ("chunk 2048 after 6144", [2048], [8192]),
             ("mixed 2048 chunk + 64 decodes @4k", [2048] + [1] * 64, [6144] + [4096] * 64)]
    for name, q_lens, ctx in cases:
        args = pool.batch(q_lens, ctx)
        flops = 4 * HQ * D * causal_pairs(q_lens, ctx)
        ms = bench_ms(lambda: run(args, q_lens, ctx), warmup, iters, flush)
        row = {"case": name, "ms": ms, "TFLOP_s": flops / ms / 1e9}
        if name.startswith("fresh"):
            batch, n = len(q_lens), q_lens[0]
            k, v = contiguous_kv(args, n)
            q4 = args[0].view(batch, n, HQ, D).transpose(1, 2)
            row["sdpa_ms"], row["sdpa_kind"] = sdpa_ms(q4, k, v, True, warmup, iters, flush)
            row["sdpa_TFLOP_s"] = flops / row["sdpa_ms"] / 1e9
            sdpa_out = F.scaled_dot_product_attention(q4, k, v, is_causal=True, enable_gqa=True)
            ref = paged_attention_ref(*args, D ** -0.5)
            row["sdpa_max_abs_err_vs_ref"] = (sdpa_out.transpose(1, 2).reshape_as(ref).float() - ref.float()).abs().max().item()
            del k, v
        rows.append(row)
        extra = (f" | sdpa[{row['sdpa_kind']}] {row['sdpa_ms'] * 1e3:8.1f} us {row['sdpa_TFLOP_s']:6.1f} TFLOP/s"
                 if "sdpa_ms" in row else "")
        print(f"  prefill {name:<36}: {ms * 1e3:8.1f} us {row['TFLOP_s']:6.1f} TFLOP/s{extra}")
    return rows


def sweep(pool, warmup, iters, flush, kinds=("decode", "prefill")) -> list[dict]:
    rows = []

    def timed(kind, call, **fields):
        try:
            ms = bench_ms(call, warmup, iters, flush)
        except Exception as e:  # noqa: BLE001 - a config that does not fit is a result too
            rows.append({"kind": kind, **fields, "error": str(e)[:200]})
            print(f"  sweep {kind} {fields}: {str(e)[:100]}")
            return None
        rows.append({"kind": kind, **fields, "ms": ms})
        return ms

    decode_cfgs = [pa._TileConfig(16, 64, 4, 3), pa._TileConfig(16, 64, 2, 3), pa._TileConfig(16, 128, 4, 3)]
    for ctx in (1024, 8192, 32768) if "decode" in kinds else ():
        for batch in (1, 4, 16, 64):
            q_lens, lens = [1] * batch, [ctx] * batch
            args = pool.batch(q_lens, lens)
            out = torch.empty_like(args[0])
            nbytes = 2 * batch * ctx * HKV * D * 2
            best = {}
            for cfg in decode_cfgs:
                for splits in (1, 2, 4, 8, 16, 32, 64):
                    if splits > 1 and (ctx // splits < 128 or batch * HKV * splits > 8192):
                        continue
                    call = lambda: pa._launch(*args, out, D ** -0.5, None, 1, splits, cfg)  # noqa: E731
                    ms = timed("decode", call, ctx=ctx, batch=batch, splits=splits, cfg=cfg.__dict__)
                    if ms is not None:
                        rows[-1]["GB_s"] = nbytes / ms / 1e6
                        key = (cfg.block_n, cfg.num_warps)
                        if key not in best or ms < best[key][1]:
                            best[key] = (splits, ms)
            print(f"  sweep decode ctx {ctx:>6} B {batch:>3}: " + "  ".join(
                f"N{n}w{w}: S{sp} {nbytes / ms / 1e6:5.0f} GB/s" for (n, w), (sp, ms) in best.items()))
    if "prefill" not in kinds:
        return rows
    prefill_cfgs = [pa._TileConfig(*c) for c in (
        (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 2), (128, 32, 4, 3),
        (64, 64, 4, 3), (64, 128, 8, 3), (256, 64, 8, 2), (256, 32, 8, 3))]
    cases = (("fresh 2048 x2", [2048] * 2, [2048] * 2), ("chunk 512 after 7680 x4", [512] * 4, [8192] * 4),
             ("mixed 2048 chunk + 64 decodes @4k", [2048] + [1] * 64, [6144] + [4096] * 64),
             # issue 12's RFC workload: a group's 16 members, 200 own tokens after a 2000-token prefix
             ("16 x 200 after 2000", [200] * 16, [2200] * 16), ("fresh 2000", [2000], [2000]))
    for name, q_lens, ctx in cases:
        args = pool.batch(q_lens, ctx)
        out = torch.empty_like(args[0])
        flops = 4 * HQ * D * causal_pairs(q_lens, ctx)
        for cfg in prefill_cfgs:
            for ahead in (False, True):
                call = lambda: pa._launch(*args, out, D ** -0.5, None, max(q_lens), 1, cfg,  # noqa: E731
                                          kv_ahead=ahead)
                ms = timed("prefill", call, case=name, cfg=cfg.__dict__, kv_ahead=ahead)
                if ms is not None:
                    rows[-1]["TFLOP_s"] = flops / ms / 1e9
                    print(f"  sweep prefill {name:<34} {cfg} ahead={ahead:d}: {ms * 1e3:7.1f} us "
                          f"{flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check_attention.json", help="JSON results path")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time split counts and tile configs")
    ap.add_argument("--sweep-kinds", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill"])
    ap.add_argument("--skip-timing", action="store_true")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    info = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "block_size": BLOCK},
            "dtype": str(DTYPE)}
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    gen = torch.Generator().manual_seed(0)
    pool = Pool(64 * 32768 + 16384)
    flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device=DEVICE)
    results = {"info": info}
    print("correctness (bf16 vs fp32 reference, atol 1.5e-2 rtol 1e-2):")
    results["correctness"] = check_correctness(pool, gen)
    if not opts.skip_timing:
        print(f"timing (median of {opts.iters}, L2 flushed):")
        results["decode"] = time_decode(pool, opts.warmup, opts.iters, flush)
        results["prefill"] = time_prefill(pool, opts.warmup, opts.iters, flush)
    if opts.sweep:
        results["sweep"] = sweep(pool, opts.warmup, opts.iters, flush, opts.sweep_kinds)
    with open(opts.out, "w") as f:
        json.dump(results, f, indent=1)
    bad = [r["case"] for r in results["correctness"] if not r["ok"]]
    print(f"wrote {opts.out}; correctness: {'all ok' if not bad else 'FAILED: ' + ', '.join(bad)}")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
