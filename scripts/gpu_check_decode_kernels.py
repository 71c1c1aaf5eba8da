"""Check and time the decode kernels of issue 13 on a GPU at Llama-3.1-8B shapes, in bf16.

1. rotary_write_kv (kernels/rotary_write_kv.py) against rotary_embedding + write_kv: bitwise
   equality, error against the fp32 reference, time at T = 1, 4, 16 tokens; then bitwise
   equality alone in bf16 and fp16, both layouts, at tests/test_rotary_write_kv.py's GPU shape
   (its fp16 "fused" case once differed by 1 ulp in 131 elements).
2. skinny_gemm (kernels/skinny_gemm.py) against cuBLAS (F.linear) for qkv, o_proj, gate_up,
   down and down with SiLU-and-mul folded in (against silu_and_mul + F.linear): error of both
   against the fp32 product, time per row count for the engine's candidate configs (and with
   --sweep a wider set at one row).
3. Decode attention at batch 1, 4, 16 and 300/1000/4000 tokens of context: the split-KV
   count the engine picks with the separate merge kernel against the splits merged in the
   kernel (fuse_kv_split_merge) and other fused counts (and key steps at batch 1); error
   against the fp32 reference, --replays graph replays of each fused call bitwise equal (the
   last-arriving program races), fused vs the merge kernel at the same tiling bitwise.
4. The engine (scripts/gpu_decode_step.py; Llama-3.1-8B preset, dummy weights, max_num_seqs 1):
   the start-up GEMM choice, then per variant (new kernels on; on but the splits merged by the
   separate kernel; all off; fused RoPE + KV write only) the GPU time of one batch-1 decode step
   replayed from its CUDA graph at --context tokens, ms/token of a greedy generation, and the
   step's kernels (torch.profiler).
Sections run in the order 1, 4, 2, 3; the JSON is rewritten after each.

Timing: each measured call is captured --rotate times (one weight tensor / buffer set each, so
the weights stream from HBM: one set of 8B layer weights is 436 MB, the L2 50 MB) into one CUDA
graph; triton.testing.do_bench replays it (L2 flushed before each replay) and the median over
replays / --rotate is the time per call, launch gaps inside a graph included, as in a decode step.

    python3 scripts/gpu_check_decode_kernels.py --out $OUT/decode_kernels.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import skinny_gemm as sg  # noqa: E402
from scripts.bench_common import capture_graph  # noqa: E402
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.kv_cache import write_kv  # noqa: E402
from kernels.paged_attention import paged_attention, paged_attention_ref  # noqa: E402
from kernels.rotary import build_cos_sin_cache, rotary_embedding  # noqa: E402
from kernels.rotary_write_kv import rotary_write_kv, rotary_write_kv_ref  # noqa: E402

HIDDEN, INTER, HQ, HKV, D, BLOCK = 4096, 14336, 32, 8, 128, 16
DTYPE, DEV = torch.bfloat16, "cuda"
PROJECTIONS = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (2 * INTER, 4096),
               "down_proj": (4096, INTER)}
# --sweep: (block_n, block_k, num_warps, num_stages, programs per SM) beyond the engine's own
ATTENTION_BATCHES, ATTENTION_CONTEXTS = (1, 4, 16), (300, 1000, 4000)
SWEEP_TILES = [(64, 64, 4, 4, 4), (64, 256, 4, 4, 1), (128, 64, 4, 4, 2), (16, 512, 4, 2, 2), (32, 128, 4, 4, 4),
               (128, 128, 4, 4, 1)]


def graph_us(calls: list) -> float:
    """Median microseconds per call: `calls` captured in one CUDA graph, replayed by do_bench."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:                      # compile, allocate outside the capture
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median")
    del graph
    return ms * 1e3 / len(calls)


def err(got: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (got.float() - ref.float()).abs().max().item()
    return {"max_abs_err": diff, "rel_err": diff / max(ref.float().abs().max().item(), 1e-30)}


def check_rotary_kv(args, out: dict) -> None:
    from engine.models.llama import compute_inv_freq
    from scripts.bench_common import PRESETS
    cfg = PRESETS["llama-3.1-8b"]
    inv_freq = compute_inv_freq(D, cfg["rope_theta"], cfg["rope_scaling"], torch.device(DEV))
    cos, sin = build_cos_sin_cache(inv_freq, cfg["max_position_embeddings"])
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    for tokens in (1, 4, 16):
        def case():
            qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, device=DEV, generator=gen).to(DTYPE)
            q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=1)
            caches = [torch.randn(4096, BLOCK, HKV, D, device=DEV, generator=gen).to(DTYPE) for _ in range(2)]
            slots = torch.randperm(4096 * BLOCK, device=DEV, generator=gen)[:tokens]
            pos = torch.randint(0, 131072, (tokens,), device=DEV, generator=gen)
            return (q.view(tokens, HQ, D), k.view(tokens, HKV, D), v.view(tokens, HKV, D), *caches, slots, pos, cos, sin)
        sets = [case() for _ in range(args.rotate)]
        a = sets[0]
        two = [t.clone() for t in a[:5]]
        fp32 = [t.float() for t in a[:5]]
        rotary_embedding(two[0], two[1], a[6], cos, sin)
        write_kv(two[1], two[2], two[3], two[4], a[5])
        ref_q, ref_k = rotary_write_kv_ref(*fp32, a[5], a[6], cos, sin)
        rotary_write_kv(*a)
        bitwise = all(torch.equal(x, y) for x, y in zip(a[:5], two))
        written = (a[5] // BLOCK, a[5] % BLOCK)
        e = [err(a[0], ref_q), err(a[1], ref_k), err(a[3][written], fp32[3][written])]
        row = {"kernel": "rotary_write_kv", "tokens": tokens, "bitwise_equal_two_kernels": bitwise,
               "max_abs_err": max(x["max_abs_err"] for x in e), "rel_err": max(x["rel_err"] for x in e),
               "fused_us": graph_us([lambda s=s: rotary_write_kv(*s) for s in sets]),
               "two_kernels_us": graph_us([lambda s=s: (rotary_embedding(s[0], s[1], s[6], cos, sin),
                                                        write_kv(s[1], s[2], s[3], s[4], s[5])) for s in sets])}
        row["GB_per_s"] = tokens * (2 * (HQ + HKV) + 3 * HKV) * D * 2 / row["fused_us"] / 1e3
        rows.append(row)
        print(f"rotary_write_kv T={tokens:3d}: bitwise={bitwise} max_err={row['max_abs_err']:.3g} "
              f"rel={row['rel_err']:.2g} | fused {row['fused_us']:.2f} us vs two kernels {row['two_kernels_us']:.2f} us")
    out["rotary_write_kv"] = rows
    check_rotary_kv_layouts(out)


# tests/test_rotary_write_kv.py's GPU shape (T, Hq, Hkv, D, block_size), its row padding and
# position range: the "fused" layout's token stride (Hq + 2Hkv) * D + 5 is not a multiple of 16,
# so Triton compiles other code for it than for contiguous q, k, v.
LAYOUT_SHAPE, LAYOUT_PAD, LAYOUT_MAX_POSITIONS = (512, 32, 8, 128, 16), 5, 4096


def layout_case(dtype, layout: str, seed: int) -> dict:
    """The test's make_case: q, k, v views into one NaN-padded qkv buffer with k and v caches the
    halves of one tensor ("fused"), or contiguous tensors ("separate"); every third slot -1."""
    tokens, hq, hkv, d, block = LAYOUT_SHAPE
    gen = torch.Generator().manual_seed(seed)
    width = (hq + 2 * hkv) * d
    buf = torch.full((tokens, width + LAYOUT_PAD), float("nan"), dtype=dtype)
    buf[:, :width] = torch.randn(tokens, width, generator=gen).to(dtype)
    buf = buf.to(DEV)
    q, k, v = (t.view(tokens, -1, d) for t in buf[:, :width].split([hq * d, hkv * d, hkv * d], dim=1))
    num_blocks = tokens // block + 3
    if layout == "fused":
        kv = torch.full((num_blocks, 2, block, hkv, d), float("nan"), dtype=dtype, device=DEV)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        k_cache = torch.full((num_blocks, block, hkv, d), float("nan"), dtype=dtype, device=DEV)
        v_cache = k_cache.clone()
    num_slots = num_blocks * block
    slots = torch.cat([torch.tensor([num_slots - 1]), torch.randperm(num_slots - 1, generator=gen)[:tokens - 1]])
    slots[2::3] = -1
    pos = torch.randint(0, LAYOUT_MAX_POSITIONS, (tokens,), generator=gen)
    pos[0] = LAYOUT_MAX_POSITIONS - 1
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=DEV) / d)
    cos, sin = build_cos_sin_cache(inv_freq, LAYOUT_MAX_POSITIONS)
    return dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots.to(DEV),
                positions=pos.to(DEV), cos_cache=cos, sin_cache=sin)


def check_rotary_kv_layouts(out: dict) -> None:
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for layout in ("separate", "fused"):
            seed = sum(LAYOUT_SHAPE)
            fused, two = layout_case(dtype, layout, seed), layout_case(dtype, layout, seed)
            rotary_write_kv(**fused)
            rotary_embedding(two["q"], two["k"], two["positions"], two["cos_cache"], two["sin_cache"])
            write_kv(two["k"], two["v"], two["k_cache"], two["v_cache"], two["slot_mapping"])
            torch.cuda.synchronize()
            differ = {name: int(((fused[name] != two[name]) & ~(fused[name].isnan() & two[name].isnan())).sum())
                      for name in ("q", "k", "v", "k_cache", "v_cache")}
            bitwise = not any(differ.values())
            dtype_name = str(dtype).removeprefix("torch.")
            rows.append({"dtype": dtype_name, "layout": layout, "shape_T_Hq_Hkv_D_block": LAYOUT_SHAPE,
                         "bitwise_equal_two_kernels": bitwise, "elements_differing": differ})
            print(f"rotary_write_kv {dtype_name:8s} {layout:8s} (T, Hq, Hkv, D, block) = {LAYOUT_SHAPE}: "
                  f"bitwise={bitwise} elements differing {differ}")
    out["rotary_write_kv_layouts"] = rows


def check_skinny(args, out: dict) -> None:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device=DEV).manual_seed(1)
    rows = []
    for name, (n, k) in PROJECTIONS.items():
        weights = [(torch.randn(n, k, device=DEV, generator=gen) / k ** 0.5).to(DTYPE) for _ in range(args.rotate)]
        variants = [(name, False)] + ([(name + "+silu_mul", True)] if name == "down_proj" else [])
        for label, silu in variants:
            for m in args.rows:
                xs = [torch.randn(m, 2 * k if silu else k, device=DEV, generator=gen).to(DTYPE) for _ in weights]
                a32 = (silu_and_mul(xs[0]) if silu else xs[0]).float()
                ref = a32 @ weights[0].float().T
                configs = sg.candidate_configs(n, k, num_sms)
                if args.sweep and m == 1:
                    configs += [c for c in (sg.SkinnyConfig(bn, bk, sg._split(n, k, bn, bk, num_sms, per), w, st)
                                            for bn, bk, w, st, per in SWEEP_TILES) if c not in configs]
                if silu:
                    base = lambda x, w: F.linear(silu_and_mul(x), w)  # noqa: E731
                else:
                    base = lambda x, w: F.linear(x, w)  # noqa: E731
                row = {"proj": label, "n": n, "k": k, "rows": m,
                       "cublas": {**err(base(xs[0], weights[0]), ref),
                                  "us": graph_us([lambda x=x, w=w: base(x, w) for x, w in zip(xs, weights)])},
                       "triton": {}}
                for c in configs:
                    try:
                        got = sg.skinny_gemm(xs[0], weights[0], silu_mul=silu, config=c)
                        us = graph_us([lambda x=x, w=w, c=c: sg.skinny_gemm(x, w, silu_mul=silu, config=c)
                                       for x, w in zip(xs, weights)])
                        row["triton"][str(c)] = {**err(got, ref), "us": us}
                    except Exception as e:          # noqa: BLE001  (a tile that does not fit)
                        row["triton"][str(c)] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                timed = {c: r for c, r in row["triton"].items() if "us" in r}
                best = min(timed, key=lambda c: timed[c]["us"])
                row["best"] = best
                weight_bytes = n * k * 2
                for r in [row["cublas"]] + list(timed.values()):
                    r["GB_per_s"] = weight_bytes / r["us"] / 1e3
                rows.append(row)
                b = timed[best]
                print(f"{label:>18} N={n:5d} K={k:5d} M={m:2d}: cuBLAS {row['cublas']['us']:7.2f} us "
                      f"({row['cublas']['GB_per_s']:5.0f} GB/s, err {row['cublas']['max_abs_err']:.3g}) | "
                      f"Triton {best} {b['us']:7.2f} us ({b['GB_per_s']:5.0f} GB/s, err {b['max_abs_err']:.3g})")
        del weights
        torch.cuda.empty_cache()
    out["skinny_gemm"] = rows


def _attention_case(batch: int, context: int, num_blocks: int, gen) -> tuple:
    """q [B, Hq, D] and one decode row per sequence over `context` keys each (the sequences'
    blocks drawn at random from the pool, so they are scattered as in a served cache)."""
    need = triton.cdiv(context, BLOCK)
    table = torch.randperm(num_blocks, device=DEV, generator=gen)[:batch * need].int().view(batch, need)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, HQ, D, device=DEV, generator=gen).to(DTYPE)
    return q, table, cu, lens


def _replays_bitwise(call, out: torch.Tensor, replays: int) -> int:
    """Replays of one captured call (its last program racing anew each time) whose output
    differs from the first replay's: 0 if the in-kernel merge is race-free."""
    graph, _ = capture_graph(call)
    graph.replay()
    first = out.clone()
    differing = 0
    for _ in range(replays):
        out.fill_(float("nan"))
        graph.replay()
        differing += int(not torch.equal(out, first))
    del graph
    return differing


def check_attention(args, out: dict) -> None:
    """Decode attention as the engine's graphs run it, per (batch, context): the separate merge
    kernel at choose_num_kv_splits' count (the engine before fuse_kv_split_merge; 1 split is
    the single-program path) against the splits merged in the kernel at choose_fused_kv_splits'
    count, plus other fused counts, and at batch 1 other key steps (BLOCK_N) for the fused
    count. Counts are those of the captured context bound (engine/cuda_graphs.py), as a graph
    of an 8B engine with max_model_len 8192 would replay."""
    from engine.cuda_graphs import decode_kv_splits, split_contexts
    from kernels import paged_attention as pa
    from kernels.arrival_counters import arrival_counters
    gen = torch.Generator(device=DEV).manual_seed(2)
    batches, contexts = ATTENTION_BATCHES, ATTENTION_CONTEXTS
    num_blocks = max(batches) * triton.cdiv(max(contexts), BLOCK) + 8
    caches = [(torch.randn(num_blocks, BLOCK, HKV, D, device=DEV, generator=gen).to(DTYPE),
               torch.randn(num_blocks, BLOCK, HKV, D, device=DEV, generator=gen).to(DTYPE)) for _ in range(args.rotate)]
    bounds = split_contexts(8192)
    scale = D ** -0.5
    rows = []
    for batch in batches:
        for context in contexts:
            q, table, cu, lens = _attention_case(batch, context, num_blocks, gen)
            bound = next(c for c in bounds if c >= context)
            apart = decode_kv_splits(batch, HKV, bound, merge_in_kernel=False)
            fused = decode_kv_splits(batch, HKV, bound, merge_in_kernel=True)
            ref = paged_attention_ref(q.float(), caches[0][0].float(), caches[0][1].float(), table, cu, lens, scale)
            row = {"batch": batch, "context": context, "context_bound": bound, "engine_splits_apart": apart,
                   "engine_splits_fused": fused, "variants": {}}
            variants = [(f"apart_s{s}", s, False, None) for s in sorted({1, apart})]
            variants += [(f"fused_s{s}", s, True, None) for s in sorted({fused, 4, 8, 16}) if s > 1]
            if batch == 1:
                variants += [(f"fused_s{fused}_n{n}", fused, True, n) for n in (32, 128)]
            for name, splits, merge, block_n in variants:
                def call(kc, vc, o=None, splits=splits, merge=merge, block_n=block_n):
                    if block_n is None:
                        return paged_attention(q, kc, vc, table, cu, lens, scale, max_seqlen_q=1, max_seqlen_k=bound,
                                               num_kv_splits=splits, merge_in_kernel=merge, out=o)
                    o = torch.empty_like(q) if o is None else o
                    cfg = pa._TileConfig(16, block_n, 4, 3)
                    pa._launch(q, kc, vc, table, cu, lens, o, scale, None, 1, splits, cfg, merge)
                    return o
                us = graph_us([lambda kc=kc, vc=vc: call(kc, vc) for kc, vc in caches])
                r = {**err(call(*caches[0]), ref), "splits": splits, "merge_in_kernel": merge,
                     "block_n": block_n or pa._pick_config(1, D, DTYPE, merge and splits > 1, num_seqs=batch).block_n, "us": us,
                     "GB_per_s": batch * context * HKV * D * 2 * 2 / us / 1e3}
                if merge:
                    o = torch.empty_like(q)
                    r["replays_differing"] = _replays_bitwise(lambda o=o: call(*caches[0], o), o, args.replays)
                    r["counters_zero"] = arrival_counters("paged_attention", q.device, 0).count_nonzero().item() == 0
                row["variants"][name] = r
            # Same tiling, the two merges: bitwise (both run _merge_splits), or how far apart.
            cfg = pa._pick_config(1, D, DTYPE, fused_splits=True, num_seqs=batch)
            two = [torch.empty_like(q) for _ in range(2)]
            for o, merge in zip(two, (False, True)):
                pa._launch(q, *caches[0], table, cu, lens, o, scale, None, 1, fused, cfg, merge)
            row["fused_vs_merge_kernel_same_tiling"] = {"bitwise": torch.equal(*two), **err(two[1], two[0])}
            v = row["variants"]
            row["engine_us_apart"] = v[f"apart_s{apart}"]["us"]
            row["engine_us_fused"] = v[f"fused_s{fused}"]["us"] if fused > 1 else v["apart_s1"]["us"]
            rows.append(row)
            fz = v.get(f"fused_s{fused}", v["apart_s1"])
            print(f"decode attention B={batch:2d} ctx {context:4d}: engine apart {apart:2d} splits "
                  f"{row['engine_us_apart']:6.2f} us | fused {fused:2d} splits {row['engine_us_fused']:6.2f} us "
                  f"(err {fz['max_abs_err']:.3g}, rel {fz['rel_err']:.2g}, replays differing "
                  f"{fz.get('replays_differing', '-')}, bitwise vs merge kernel "
                  f"{row['fused_vs_merge_kernel_same_tiling']['bitwise']})")
            print("    " + ", ".join(f"{k} {r['us']:.2f}" for k, r in v.items()))
    out["attention_decode"] = rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--rows", default="1,4,16", help="x rows for the GEMMs")
    ap.add_argument("--rotate", type=int, default=8, help="weight tensors / buffer sets cycled per timing (>= 8)")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="only the engine's candidate configs")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: rotary,gemm,attention,engine")
    ap.add_argument("--context", type=int, default=300, help="engine: context of the timed decode step")
    ap.add_argument("--output-len", type=int, default=128, help="engine: tokens per timed generation")
    ap.add_argument("--top-kernels", type=int, default=16, help="engine: kernels listed per variant")
    ap.add_argument("--replays", type=int, default=50, help="attention: replays checked bitwise per fused call")
    ap.add_argument("--budget-s", type=float, default=290, help="seconds the whole run should take at most")
    args = ap.parse_args()
    args.rows = [int(m) for m in args.rows.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    props = torch.cuda.get_device_properties(0)
    out = {"gpu": props.name, "num_sms": props.multi_processor_count, "torch": torch.__version__,
           "triton": triton.__version__, "rotate": args.rotate, "commit": os.environ.get("BENCH_COMMIT", "")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    t0 = time.perf_counter()
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    from scripts.gpu_decode_step import check_engine
    # The engine's step (what issue 13 is judged by) before the wide GEMM sweep.
    sections = [("rotary", check_rotary_kv), ("engine", check_engine), ("gemm", check_skinny),
                ("attention", check_attention)]
    for name, fn in sections:
        if name in skip:
            continue
        if name == "gemm" and args.sweep and time.perf_counter() - t0 > args.budget_s - 150:
            print("less than 150 s of the time budget left: GEMM sweep off")
            args.sweep = False
        start = time.perf_counter()
        try:
            fn(args, out)
        except Exception as e:          # noqa: BLE001  (keep the other sections' results)
            import traceback
            traceback.print_exc()
            out.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
        out.setdefault("section_s", {})[name] = time.perf_counter() - start
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        gc.collect()
        torch.cuda.empty_cache()
    print(f"done in {time.perf_counter() - t0:.0f} s; results in {args.out}")
    if out.get("errors"):
        sys.exit(1)


if __name__ == "__main__":
    main()
