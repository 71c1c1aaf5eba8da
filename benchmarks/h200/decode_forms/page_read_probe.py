"""How fast can a decode step's K/V pages be read at all? The plain decode kernel reads 256 rows x
~1,700 keys at ~4.2 TB/s (token_budget_ace0975.md section 2); a read-only stream reached 4.4
(fp8_kv_cache.md) and the device copy 4.28. This probe times, at the same shapes, kernels that
only read: the attention's own gather (kernels/paged_attention.py `_kv_tiles`, one step ahead
as its decode loop loads, one program a (row, kv head)) summed instead of attended, over the
engine's layout [blocks, page, Hkv, D] and a head-major one [blocks, Hkv, page, D] (a permuted
view: the same strides the kernels take); a flat read of the same bytes; and `paged_attention`
itself in both layouts. CUDA graphs of 32 calls, median of 7 replays. Twenty-fifth session.
Kept as run: on the H200 the read-only kernels here ran at 2.2-3.2 TB/s, slower than the
attention (4.19) and the device copy (4.25), so they bound nothing (benchmarks/h200/page_read.md).

    PYTHONPATH=. python3 benchmarks/h200/decode_forms/page_read_probe.py --out $OUT/page_read.json
    PYTHONPATH=. python3 benchmarks/h200/decode_forms/page_read_probe.py --cpu-check   # interpreter
"""
import argparse
import json
import os
import sys

if "--cpu-check" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from kernels.paged_attention import _kv_tiles, paged_attention  # noqa: E402


@triton.jit
def _gather_read(k_cache, v_cache, block_table, seq_lens, out, stride_bt, stride_kb, stride_ks, stride_kh,
                 stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    k_stop = tl.load(seq_lens + b)
    table_row = block_table + b * stride_bt
    k_base = k_cache + h * stride_kh
    v_base = v_cache + h * stride_vh
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    k, v = _kv_tiles(table_row, k_base, v_base, 0, k_stop, stride_kb, stride_ks, stride_kd, stride_vb,
                     stride_vs, stride_vd, BLOCK_N, HEAD_DIM, PAGE_SIZE, True, True)
    for start in range(0, k_stop, BLOCK_N):
        k_next, v_next = _kv_tiles(table_row, k_base, v_base, start + BLOCK_N, k_stop, stride_kb, stride_ks,
                                   stride_kd, stride_vb, stride_vs, stride_vd, BLOCK_N, HEAD_DIM, PAGE_SIZE,
                                   True, True)
        acc += tl.sum(k.to(tl.float32), 1) + tl.sum(v.to(tl.float32), 0)
        k, v = k_next, v_next
    tl.store(out + (b * tl.num_programs(1) + h) * HEAD_DIM + tl.arange(0, HEAD_DIM), acc)


@triton.jit
def _flat_read(x, n, out, BLOCK: tl.constexpr, PER: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * PER
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(PER):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), acc)


def gather_read(k_cache, v_cache, block_table, seq_lens, out, warps=4):
    nb, page, hkv, d = k_cache.shape
    _gather_read[(seq_lens.shape[0], hkv)](
        k_cache, v_cache, block_table, seq_lens, out, block_table.stride(0), *k_cache.stride(), *v_cache.stride(),
        BLOCK_N=128, HEAD_DIM=d, PAGE_SIZE=page, num_warps=warps)


def flat_read(x, out, block=4096, per=8):
    n = x.numel()
    _flat_read[(triton.cdiv(n, block * per),)](x, n, out, BLOCK=block, PER=per, num_warps=8)


def make_case(rows, keys, hkv, d, page, dtype, device, gen):
    """K, V in the engine's layout, the same values head-major (a permuted view of a [blocks, Hkv,
    page, D] copy), a block table of scattered pages (as in a long-running cache), lengths."""
    blocks_per = -(-keys // page)
    nb = rows * blocks_per
    k = torch.randn(nb, page, hkv, d, dtype=dtype, device=device, generator=gen)
    v = torch.randn(nb, page, hkv, d, dtype=dtype, device=device, generator=gen)
    k_hm, v_hm = (x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for x in (k, v))
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=torch.int32)
    table = perm.view(rows, blocks_per).contiguous()
    lens = torch.full((rows,), keys, dtype=torch.int32, device=device)
    return {"engine": (k, v), "head-major": (k_hm, v_hm)}, table, lens


def cpu_check():
    gen = torch.Generator().manual_seed(0)
    layouts, table, lens = make_case(3, 300, 2, 16, 16, torch.float32, "cpu", gen)
    for layout, (k, v) in layouts.items():
        out = torch.empty(3 * 2 * 16)
        gather_read(k, v, table, lens, out)
        ref = torch.stack([torch.stack([k[table[b].long()][:, :, h].reshape(-1, 16)[:300].sum(0)
                                        + v[table[b].long()][:, :, h].reshape(-1, 16)[:300].sum(0)
                                        for h in range(2)]) for b in range(3)]).reshape(-1)
        diff = float((out - ref).abs().max())
        print(f"gather read, {layout}: max diff {diff:.1e}")
        assert diff < 1e-3
    x = torch.randn(100_000)
    out = torch.empty(triton.cdiv(x.numel(), 1024 * 4) * 1024)
    flat_read(x, out, 1024, 4)
    print(f"flat read: diff {abs(float(out.sum()) - float(x.sum())):.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=["256x1700", "128x1700", "256x1000"], help="ROWSxKEYS")
    ap.add_argument("--out")
    ap.add_argument("--cpu-check", action="store_true")
    args = ap.parse_args()
    if args.cpu_check:
        cpu_check()
        return
    from engine.gemm_tuning import replay_ms
    from scripts.bench_common import git_commit, hardware
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    hq, hkv, d, page, calls = 32, 8, 128, 16, 32
    result = {"hardware": hardware(), "commit": os.environ.get("BENCH_COMMIT") or git_commit(),
              "command": " ".join(sys.argv), "rows": []}
    for case in args.cases:
        rows, keys = map(int, case.split("x"))
        nbytes = 2 * rows * keys * hkv * d * 2
        q = torch.randn(rows, hq, d, dtype=torch.bfloat16, device=dev, generator=gen)
        cu = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        outs = {}
        layouts, table, lens = make_case(rows, keys, hkv, d, page, torch.bfloat16, dev, gen)
        red = torch.empty(rows * hkv * d, dtype=torch.float32, device=dev)
        for layout, (k, v) in layouts.items():
            def attn(k=k, v=v):
                return paged_attention(q, k, v, table, cu, lens, d ** -0.5, max_seqlen_q=1, max_seqlen_k=keys,
                                       merge_in_kernel=True)
            outs[layout] = attn().clone()
            for name, fn in ((f"gather read, {layout}", lambda k=k, v=v: gather_read(k, v, table, lens, red)),
                             (f"paged_attention, {layout}", attn)):
                ms = replay_ms(lambda: [fn() for _ in range(calls)], dev) / calls
                result["rows"].append(dict(case=case, kernel=name, us=ms * 1e3, tb_s=nbytes / ms / 1e9))
                print(f"{case:9} {name:32} {ms * 1e3:7.1f} us {nbytes / ms / 1e9:5.2f} TB/s", flush=True)
        k, v = layouts["engine"]
        flat = torch.empty(triton.cdiv(k.numel(), 4096 * 8) * 4096, dtype=torch.float32, device=dev)
        ms = replay_ms(lambda: [(flat_read(k, flat), flat_read(v, flat)) for _ in range(calls)], dev) / calls
        result["rows"].append(dict(case=case, kernel="flat read", us=ms * 1e3, tb_s=nbytes / ms / 1e9))
        print(f"{case:9} {'flat read':32} {ms * 1e3:7.1f} us {nbytes / ms / 1e9:5.2f} TB/s", flush=True)
        ms = replay_ms(lambda: [k.copy_(v) for _ in range(calls // 2)], dev) / (calls // 2)
        result["rows"].append(dict(case=case, kernel="copy (V into K: half the bytes read, half written)",
                                   us=ms * 1e3, tb_s=nbytes / ms / 1e9))
        print(f"{case:9} {'copy V into K (bytes moved)':32} {ms * 1e3:7.1f} us {nbytes / ms / 1e9:5.2f} TB/s", flush=True)
        same = torch.equal(outs["engine"], outs["head-major"])
        result["rows"].append(dict(case=case, attention_same_bits_in_both_layouts=same))
        print(f"{case:9} attention, same bits in both layouts: {same}", flush=True)
        del layouts, k, v
        torch.cuda.empty_cache()
        if args.out:
            json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
