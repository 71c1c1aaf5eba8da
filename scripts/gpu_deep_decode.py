"""A decode-attention probe built like the streaming read of sm_bandwidth.md (issue 13).

sm_bandwidth.md measured the plain decode kernel's exact access pattern (16-token pages through a
block table, one kv head's 256-byte rows) streaming at 4.45-4.55 TB/s, against the kernel's own
4.21: the kernel leaves 6-8%. The pattern's best rates came from few programs (one an SM) with
deep pipelines (6-8 stages), where the plain kernel runs 2 programs an SM at 3 stages, and the
earlier persistent forms (decode_attention_forms.md section 1) 2-3 stages.

This probe is the minimal decode attention in that form, for equal-length sequences whose key
count is a multiple of BLOCK_N (no masks, no splits, no sliding window): `programs` programs walk
the call's (sequence, kv head) items, program p taking items p, p + programs, ..., in ONE flat
loop over all their key tiles, so the pipeline never drains between items. At an item's first
tile the online softmax restarts; at its last the item's rows are written. It is timed beside
`paged_attention` as the engine's decode graphs call it, on the same batch, and checked against it.

    PYTHONPATH=. python3 scripts/gpu_deep_decode.py --out $OUT/deep_decode.json
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (name, programs, BLOCK_N, warps, stages); programs 0 = one a (sequence, kv head), as the plain kernel
CONFIGS = [
    ("p128 n64 w4 s6", 128, 64, 4, 6), ("p128 n64 w8 s6", 128, 64, 8, 6), ("p128 n128 w8 s4", 128, 128, 8, 4),
    ("p132 n64 w4 s6", 132, 64, 4, 6), ("p256 n64 w4 s4", 256, 64, 4, 4), ("p256 n64 w4 s3", 256, 64, 4, 3),
    ("p264 n64 w4 s4", 264, 64, 4, 4), ("p128 n32 w4 s8", 128, 32, 4, 8),
]
CASES = [(256, 1600), (256, 1024), (384, 1504), (128, 2048)]       # (sequences, keys each)


@triton.jit
def _deep_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, out_ptr, num_items, tiles_an_item, table_stride, scale,
                        HKV: tl.constexpr, G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                        D: tl.constexpr, PAGE: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    my_items = (num_items - pid + programs - 1) // programs
    rows = tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, D)
    keys = tl.arange(0, BLOCK_N)
    row_ok = rows < G
    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, D], tl.float32)
    for step in tl.range(0, my_items * tiles_an_item, num_stages=STAGES):
        item = pid + (step // tiles_an_item) * programs
        tile = step % tiles_an_item
        seq = item // HKV
        head = item % HKV
        first = tile == 0
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        acc = tl.where(first, 0.0, acc)
        q_rows = (seq * HKV * G + head * G + rows) * D
        q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
        tok = tile * BLOCK_N + keys
        page = tl.load(table_ptr + seq * table_stride + tok // PAGE)
        kv_rows = ((page * PAGE + tok % PAGE) * HKV + head) * D
        k = tl.load(k_ptr + kv_rows[:, None] + dims[None, :])
        s = tl.dot(q, tl.trans(k)) * scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_rows[:, None] + dims[None, :])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        last = tile == tiles_an_item - 1          # a masked store, not a branch: one straight loop body
        tl.store(out_ptr + q_rows[:, None] + dims[None, :], (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & last)


def deep_decode(q, k_cache, v_cache, block_table, num_keys: int, scale: float, programs: int, block_n: int,
                warps: int, stages: int, out=None) -> torch.Tensor:
    """Decode attention of q [B, Hq, D] over each sequence's first `num_keys` keys (a multiple of
    block_n; block_n a multiple of the page or the page of block_n) in the paged caches
    [blocks, page, Hkv, D]."""
    batch, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    if num_keys % block_n or (block_n % page and page % block_n):
        raise ValueError(f"num_keys must be a multiple of block_n ({block_n}), and block_n of the page ({page}) "
                         "or the page of block_n")
    out = torch.empty_like(q) if out is None else out
    items = batch * hkv
    _deep_decode_kernel[(min(programs, items),)](
        q, k_cache, v_cache, block_table, out, items, num_keys // block_n, block_table.stride(0), scale,
        HKV=hkv, G=hq // hkv, BLOCK_Q=max(16, triton.next_power_of_2(hq // hkv)), BLOCK_N=block_n, D=d,
        PAGE=page, STAGES=stages, num_warps=warps)
    return out


def main() -> None:
    import triton.testing

    from kernels.paged_attention import choose_fused_kv_splits, paged_attention
    from scripts.bench_common import graph_us_a_call, write_probe

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=[c[0] for c in CONFIGS], choices=[c[0] for c in CONFIGS])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    hq, hkv, d, page, layers = 32, 8, 128, 16, 32
    rows = []
    for batch, keys in CASES:
        gen = torch.Generator(device="cuda").manual_seed(batch + keys)
        pages = keys // page
        blocks = batch * pages + 64
        k = torch.randn(blocks, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(blocks, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        table = torch.randperm(blocks, device="cuda", generator=gen)[:batch * pages].view(batch, pages).to(torch.int32)
        q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        lens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
        kv_bytes = batch * keys * hkv * d * 2 * 2
        plain_out = torch.empty_like(q)
        splits = choose_fused_kv_splits(batch, hkv, keys)

        def plain():
            paged_attention(q, k, v, table, cu, lens, d ** -0.5, max_seqlen_q=1, max_seqlen_k=keys,
                            num_kv_splits=splits, merge_in_kernel=True, out=plain_out)
        us = graph_us_a_call(plain, layers)
        rows.append(dict(case=f"{batch} x {keys}", kernel="plain", us=us, TB_s=kv_bytes / us / 1e6, max_diff=0.0))
        print(f"{batch:4d} x {keys:5d} plain            {us:7.1f} us  {kv_bytes / us / 1e6:.2f} TB/s", flush=True)
        for name, programs, block_n, warps, stages in [c for c in CONFIGS if c[0] in args.configs]:
            out = torch.empty_like(q)
            try:
                us = graph_us_a_call(lambda: deep_decode(q, k, v, table, keys, d ** -0.5, programs, block_n, warps,
                                                         stages, out=out), layers)
            except Exception as e:        # a config that does not fit (shared memory, registers): say so, go on
                rows.append(dict(case=f"{batch} x {keys}", kernel=name, error=f"{type(e).__name__}: {e}"[:300]))
                print(f"{batch:4d} x {keys:5d} {name:16s} error {rows[-1]['error'][:120]}", flush=True)
                continue
            diff = (out.float() - plain_out.float()).abs().max().item()
            rows.append(dict(case=f"{batch} x {keys}", kernel=name, us=us, TB_s=kv_bytes / us / 1e6, max_diff=diff))
            print(f"{batch:4d} x {keys:5d} {name:16s} {us:7.1f} us  {kv_bytes / us / 1e6:.2f} TB/s  "
                  f"max|diff| vs plain {diff:.1e}", flush=True)
        del k, v
        torch.cuda.empty_cache()
    write_probe(args.out, rows, layers=layers)


if __name__ == "__main__":
    main()
