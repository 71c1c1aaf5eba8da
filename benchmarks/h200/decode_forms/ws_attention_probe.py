"""Is triton 3.6's Hopper warp specialization worth a prompt-attention kernel? Times one minimal
flash-attention loop (no mask, contiguous Q/K/V, bf16, head dim 128) in the forms
warp_specialize_sm90.py compiles: pointer loads at 8 warps (the FA2 structure our prompt tiles
have), TMA descriptors at 8 warps, and TMA descriptors at 4 warps with `warp_specialize=True`
(a producer and two consumer warp groups, 12 warps), beside torch's SDPA. Each form is checked
against SDPA first. Kept as run (twenty-third session).

    python3 benchmarks/h200/decode_forms/ws_attention_probe.py --out $OUT/ws_attention.json
    python3 benchmarks/h200/decode_forms/ws_attention_probe.py --cpu-check   # float32, interpreter
"""
import argparse
import json
import math
import os
import sys

if "--cpu-check" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


@triton.jit
def _attn_pointers(Q, K, V, O, N, qk_scale, WS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   D: tl.constexpr):
    head = tl.program_id(1).to(tl.int64) * N * D
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + head + offs_m[:, None] * D + offs_d[None, :])
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for start in tl.range(0, N, BN, warp_specialize=WS):
        offs_n = start + tl.arange(0, BN)
        qk = tl.dot(q, tl.load(K + head + offs_n[None, :] * D + offs_d[:, None])) * qk_scale
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(V.dtype.element_ty), tl.load(V + head + offs_n[:, None] * D + offs_d[None, :]),
                     acc * alpha[:, None])
        m_i = m_ij
    tl.store(O + head + offs_m[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty))


@triton.jit
def _attn_descriptors(Q, K, V, O, N, H, qk_scale, WS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      D: tl.constexpr):
    rows = H * N
    qd = tl.make_tensor_descriptor(Q, shape=[rows, D], strides=[D, 1], block_shape=[BM, D])
    kd = tl.make_tensor_descriptor(K, shape=[rows, D], strides=[D, 1], block_shape=[BN, D])
    vd = tl.make_tensor_descriptor(V, shape=[rows, D], strides=[D, 1], block_shape=[BN, D])
    od = tl.make_tensor_descriptor(O, shape=[rows, D], strides=[D, 1], block_shape=[BM, D])
    head = tl.program_id(1) * N
    q = qd.load([head + tl.program_id(0) * BM, 0])
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for start in tl.range(0, N, BN, warp_specialize=WS):
        qk = tl.dot(q, kd.load([head + start, 0]).T) * qk_scale
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(V.dtype.element_ty), vd.load([head + start, 0]), acc * alpha[:, None])
        m_i = m_ij
    od.store([head + tl.program_id(0) * BM, 0], (acc / l_i[:, None]).to(O.dtype.element_ty))


# name -> (kernel, warps, stages, warp_specialize, keys a step)
FORMS = {
    "pointers, 8 warps (FA2 form)": ("pointers", 8, 3, False, 64),
    "descriptors, 8 warps": ("descriptors", 8, 3, False, 64),
    "descriptors, 4 warps + warp_specialize": ("descriptors", 4, 3, True, 64),
    "descriptors, 4 warps + warp_specialize, 128 keys, 2 stages": ("descriptors", 4, 2, True, 128),
}


def run_form(form, q, k, v, out):
    kind, warps, stages, ws, bn = form
    heads, n, d = q.shape
    qk_scale = 1.0 / math.sqrt(d) * 1.4426950408889634
    grid = (n // 128, heads)
    if kind == "pointers":
        _attn_pointers[grid](q, k, v, out, n, qk_scale, WS=ws, BM=128, BN=bn, D=d, num_warps=warps,
                             num_stages=stages)
    else:
        _attn_descriptors[grid](q, k, v, out, n, heads, qk_scale, WS=ws, BM=128, BN=bn, D=d,
                                num_warps=warps, num_stages=stages)


def cpu_check() -> None:
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    q, k, v = (torch.randn(2, 256, 128, generator=torch.Generator().manual_seed(i)) for i in range(3))
    ref = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
    for name, form in FORMS.items():
        out = torch.empty_like(q)
        run_form(form, q, k, v, out)
        diff = float((out - ref).abs().max())
        print(f"{name:60} max diff {diff:.2e}")
        assert diff < 1e-4, name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--heads", type=int, default=128, help="batch x heads")
    ap.add_argument("--out")
    ap.add_argument("--cpu-check", action="store_true", help="every form against SDPA, float32, interpreter")
    args = ap.parse_args()
    if args.cpu_check:
        cpu_check()
        return
    from scripts.bench_common import git_commit, hardware
    dev = torch.device("cuda")
    scratch = {}

    def alloc(size, align, stream):
        if size not in scratch:
            scratch[size] = torch.empty(size, device=dev, dtype=torch.int8)
        return scratch[size]
    triton.set_allocator(alloc)
    rows = []
    for n in args.seqs:
        heads = max(1, args.heads * 4096 // n)         # about the same work per case
        q, k, v = (torch.randn(heads, n, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
        ref = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
        flops = 4 * heads * n * n * 128
        ms = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q[None], k[None], v[None]))
        rows.append({"n": n, "heads": heads, "form": "torch SDPA", "ms": ms, "tflops": flops / ms / 1e9})
        print(f"N={n:5d} x {heads:3d}: {'torch SDPA':60} {ms:8.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
        for name, form in FORMS.items():
            out = torch.empty_like(q)
            row = {"n": n, "heads": heads, "form": name}
            try:
                run_form(form, q, k, v, out)
                torch.cuda.synchronize()
                row["max_diff"] = float((out.float() - ref.float()).abs().max())
                if not row["max_diff"] <= 0.05:     # NaN fails too (f5ea94b's run timed NaN rows)
                    row["error"] = "differs from SDPA"
                else:
                    row["ms"] = triton.testing.do_bench(lambda: run_form(form, q, k, v, out))
                    row["tflops"] = flops / row["ms"] / 1e9
            except Exception as e:      # a form that does not compile is a result here
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(f"N={n:5d} x {heads:3d}: {name:60} " + (f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s"
                  if "ms" in row else row["error"]) + f"  (max diff {row.get('max_diff', float('nan')):.4f})",
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": {"hardware": hardware(), "commit": git_commit(),
                                "command": "python3 benchmarks/h200/decode_forms/ws_attention_probe.py "
                                + " ".join(sys.argv[1:])}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
