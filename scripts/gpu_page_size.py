"""KV page sizes (`EngineConfig.block_size`) 16 / 32 / 64 / 128 under the decode, prompt and cascade
attention (issues 12, 13). The engine pages its cache 16 tokens a block, as vLLM does;
TensorRT-LLM's default is 64. Do the kernels read faster from larger pages (fewer block-table
lookups, longer runs of one head's keys)?

paged_attention: each case's keys and values are the same tokens at every page size: a logical
pool, each page size's cache holding its pages at random physical blocks (as a long-running
engine's free list leaves them), the block tables pointing there. Outputs are compared with the
16-token pages' output (max |diff|: the kernel's order of work does not depend on the page size,
so 0 is expected). cascade_attention: the RFC job's decode shape (groups of 16, a 2,048-token
prefix, 250 own tokens), its own random cache per page size, side by side as the engine runs it
and in turn, checked against the plain kernel on the same batch.

Each form: 32 calls in one CUDA graph, the median replay with L2 flushed (bench_common.
graph_us_a_call), us a call, and the K/V bytes' rate.

    PYTHONPATH=. python3 scripts/gpu_page_size.py --out $OUT/page_size.json
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYERS = 32
PAGE_SIZES = (16, 32, 64, 128)
LARGEST = max(PAGE_SIZES)
# (name, query tokens a sequence, keys a sequence)
PAGED_CASES = [
    ("decode 256 x 1620", [1] * 256, [1620] * 256),
    ("decode 384 x 1500", [1] * 384, [1500] * 384),
    ("decode 64 x 1000", [1] * 64, [1000] * 64),
    ("decode 1 x 4000", [1], [4000]),
    ("prompt 8 fresh x 1000", [1000] * 8, [1000] * 8),
    ("prompt 16 x 200 after 2048", [200] * 16, [2248] * 16),
]
# (decode rows, group size, prefix tokens, own tokens)
CASCADE_CASES = [(512, 16, 2048, 250), (256, 16, 2048, 250)]


def page_layout(k_log, v_log, padded: list[int], page: int, gen):
    """The logical pool's sequences (one after another, sequence b `padded[b]` tokens, whole pages)
    as a cache of `page`-token blocks at random physical blocks: (k_cache, v_cache, block_table)."""
    import torch

    total, (_, hkv, d) = sum(padded), k_log.shape
    num_blocks = total // page
    perm = torch.randperm(num_blocks, device=k_log.device, generator=gen)
    k = torch.empty(num_blocks, page, hkv, d, device=k_log.device, dtype=k_log.dtype)
    v = torch.empty_like(k)
    k[perm], v[perm] = k_log.view(num_blocks, page, hkv, d), v_log.view(num_blocks, page, hkv, d)
    table = torch.zeros(len(padded), max(padded) // page, dtype=torch.int32, device=k_log.device)
    start = 0
    for b, p in enumerate(padded):
        table[b, :p // page] = perm[start // page:(start + p) // page]
        start += p
    return k, v, table


def paged_case(name, q_lens, ctx, args, rows) -> None:
    import torch
    import triton

    from kernels.paged_attention import choose_fused_kv_splits, paged_attention
    from scripts.bench_common import graph_us_a_call
    from scripts.gpu_check_attention import D, DEVICE, DTYPE, HKV, HQ

    gen = torch.Generator(device=DEVICE).manual_seed(len(ctx) * 7 + max(ctx))
    padded = [triton.cdiv(n, LARGEST) * LARGEST for n in ctx]       # each sequence whole pages at every size
    total = sum(padded)
    k_log = torch.randn(total, HKV, D, device=DEVICE, dtype=DTYPE, generator=gen)
    v_log = torch.randn(total, HKV, D, device=DEVICE, dtype=DTYPE, generator=gen)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    q = torch.randn(int(cu[-1]), HQ, D, device=DEVICE, dtype=DTYPE, generator=gen)
    cu, lens = cu.to(DEVICE), torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    kv_bytes = sum(ctx) * HKV * D * 2 * DTYPE.itemsize
    decode = max(q_lens) == 1          # as the engine's decode graphs call it: splits merged in the kernel
    splits = dict(num_kv_splits=choose_fused_kv_splits(len(ctx), HKV, max(ctx)), merge_in_kernel=True) if decode else {}
    first = None
    for page in args.page_sizes:
        k, v, table = page_layout(k_log, v_log, padded, page, gen)
        out = torch.empty_like(q)

        def call():
            paged_attention(q, k, v, table, cu, lens, D ** -0.5, max_seqlen_q=max(q_lens),
                            max_seqlen_k=max(ctx), out=out, **splits)
        us = graph_us_a_call(call, LAYERS)
        first = out.clone() if first is None else first
        diff = (out.float() - first.float()).abs().max().item()
        rows.append(dict(kernel="paged_attention", case=name, page_size=page, us=us, kv_TB_s=kv_bytes / us / 1e6,
                         max_diff_vs_first_page_size=diff))
        print(f"{name:30s} page {page:4d}: {us:8.1f} us ({kv_bytes / us / 1e6:.2f} TB/s)  max|diff| {diff:.2e}",
              flush=True)
        del k, v, table
        torch.cuda.empty_cache()


def cascade_case(num_rows, size, prefix, own, args, rows) -> None:
    import torch

    import scripts.gpu_check_cascade as gcc
    from scripts.bench_common import graph_us_a_call

    for page in args.page_sizes:
        gcc.BLOCK = page                   # Batch lays its cache out in pages of gcc.BLOCK tokens
        batch = gcc.Batch(gcc.decode_groups(size, prefix, num_rows=num_rows, own_len=own), seed=num_rows + own)
        plain = batch.plain()
        kv_bytes = ((num_rows // size) * prefix + num_rows * own) * gcc.kv_bytes_per_token()
        for form in ("side_by_side", "in_turn"):
            out = torch.empty_like(batch.q)
            us = graph_us_a_call(lambda: batch.cascade(out=out, side_by_side=form == "side_by_side"), LAYERS)
            diff = (out.float() - plain.float()).abs().max().item()
            name = f"decode {num_rows} rows, groups of {size}, {prefix} + {own}"
            rows.append(dict(kernel="cascade_attention", form=form, case=name, page_size=page, us=us,
                             kv_TB_s=kv_bytes / us / 1e6, max_diff_vs_plain=diff))
            print(f"{name:40s} {form:12s} page {page:4d}: {us:8.1f} us ({kv_bytes / us / 1e6:.2f} TB/s)  "
                  f"max|diff| vs plain {diff:.2e}", flush=True)
        del batch, plain
        torch.cuda.empty_cache()
    gcc.BLOCK = 16


def main() -> None:
    import torch

    from scripts.bench_common import write_probe

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=list(PAGE_SIZES))
    ap.add_argument("--skip-cascade", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if any(LARGEST % p for p in args.page_sizes):
        raise SystemExit(f"--page-sizes must divide {LARGEST}")
    rows: list[dict] = []
    for name, q_lens, ctx in PAGED_CASES:
        paged_case(name, q_lens, ctx, args, rows)
    if not args.skip_cascade:
        for case in CASCADE_CASES:
            cascade_case(*case, args, rows)
    write_probe(args.out, rows, layers=LAYERS, page_sizes=args.page_sizes)


if __name__ == "__main__":
    main()
