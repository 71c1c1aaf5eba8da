"""Is the decode attention over an FP8 KV cache bound by widening the cache's values?

fp8_kv_cache.md: unsplit FP8 decode reads at ~3.0 TB/s of FP8 bytes where the bf16 cache's reads
run at ~4.0; every key and value is widened to fp16 (one cvt a pair) and goes through shared
memory at twice its cached size before the dots. This probe times one simplified unsplit decode
kernel (the engine's loop: block ids a step ahead, K key by key, the mask on every step; 16-row
tiles holding a kv head's 4 query heads, 128 keys a step, 4 warps, 3 stages) in four forms:

- `f16`: K and V widened to fp16, q in fp16, both dots in fp16 (the engine's form);
- `qk8`: q quantized to e4m3 in the kernel (one scale a row), q.K on FP8 tensor cores from the
  cache's bytes as they are; p.V as `f16`;
- `pv8`: q.K as `f16`; p (in [0, 1]) times 256 to e4m3, p.V on FP8 tensor cores;
- `both8`: both dots in FP8, nothing widened;

and, for scale, the same kernel over a bf16 cache (`bf16`) and the engine's own kernel over both
caches (`engine_fp8`, `engine_bf16`). Each FP8 form's error against the fp32 reference on the
same FP8 cache is reported beside `f16`'s: the FP8 dots round q or p to 3 mantissa bits.

    PYTHONPATH=. python3 benchmarks/h200/fp8_decode/fp8_dot_probe.py --out $OUT/fp8_dot.json
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/h200/fp8_decode/fp8_dot_probe.py --cpu-check
"""
import argparse
import json
import os

import torch
import triton
import triton.language as tl

HQ, HKV, D, PAGE, GROUP = 32, 8, 128, 16, 4
FORMS = {"f16": 0, "qk8": 1, "pv8": 2, "both8": 3}


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, lens_ptr, qk_scale, stride_bt,
                   FORM: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, NUM_KV: tl.constexpr, G: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, 16)
    head = kv_head * G + rows
    row_ok = rows < G
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (seq * NUM_KV * G + head)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    fp8_cache = k_ptr.dtype.element_ty == tl.float8e4nv
    q_scale = tl.full([16], 1.0, dtype=tl.float32)
    if FORM == 1 or FORM == 3:
        q_scale = tl.maximum(tl.max(tl.abs(q), axis=1), 1e-12) / 448.0
        q_dot = (q / q_scale[:, None]).to(tl.float8e4nv)
    elif fp8_cache:
        q_dot = q.to(tl.float16)
    else:
        q_dot = q.to(k_ptr.dtype.element_ty)
    seq_len = tl.load(lens_ptr + seq)
    table_row = table_ptr + seq * stride_bt
    kv_off = kv_head * HEAD_DIM
    m_i = tl.full([16], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([16], dtype=tl.float32)
    acc = tl.zeros([16, HEAD_DIM], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    ids = tl.load(table_row + offs_n // PAGE_SIZE, mask=offs_n < seq_len, other=0)
    for start in range(0, seq_len, BLOCK_N):
        k_pos = start + offs_n
        k_in = k_pos < seq_len
        nxt = k_pos + BLOCK_N
        next_ids = tl.load(table_row + nxt // PAGE_SIZE, mask=nxt < seq_len, other=0)
        base = (ids * (PAGE_SIZE * NUM_KV * HEAD_DIM) + (k_pos % PAGE_SIZE) * (NUM_KV * HEAD_DIM) + kv_off)
        ptrs = base[:, None] + offs_d[None, :]
        k = tl.load(k_ptr + ptrs, mask=k_in[:, None], other=0.0)
        v = tl.load(v_ptr + ptrs, mask=k_in[:, None], other=0.0)
        ids = next_ids
        if FORM == 1 or FORM == 3:
            s = tl.dot(q_dot, tl.trans(k)) * (q_scale * qk_scale)[:, None]
        else:
            s = tl.dot(q_dot, tl.trans(k.to(q_dot.dtype))) * qk_scale
        s = tl.where(k_in[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FORM == 2 or FORM == 3:
            acc = acc * alpha[:, None] + tl.dot((p * 256.0).to(tl.float8e4nv), v) * (1.0 / 256.0)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q_dot.dtype if FORM != 1 else tl.float16),
                                                v.to(q_dot.dtype if FORM != 1 else tl.float16))
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (seq * NUM_KV * G + head)[:, None] * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def decode(q, k_cache, v_cache, table, lens, form, scale):
    batch = lens.numel()
    out = torch.empty_like(q)
    _decode_kernel[(batch, HKV)](q, k_cache, v_cache, out, table, lens, scale * 1.4426950408889634,
                                 table.stride(0), FORM=FORMS[form], BLOCK_N=128, HEAD_DIM=D,
                                 PAGE_SIZE=PAGE, NUM_KV=HKV, G=GROUP, num_warps=4, num_stages=3)
    return out


def make_case(batch, ctx, device, dtype, seed=0):
    from kernels.attention_ref import to_cache_dtype
    per_seq = -(-ctx // PAGE)
    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(batch * per_seq, PAGE, HKV, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(batch * per_seq, PAGE, HKV, D, device=device, dtype=dtype, generator=g)
    table = torch.randperm(batch * per_seq, device=device, generator=g).to(torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    q = torch.randn(batch, HQ, D, device=device, dtype=dtype, generator=g)
    fp8 = torch.float8_e4m3fn
    return q, (k, v), (to_cache_dtype(k, fp8), to_cache_dtype(v, fp8)), table, lens


def reference(q, k, v, table, lens, scale):
    from kernels.attention_ref import paged_attention_ref
    batch = lens.numel()
    cu = torch.arange(batch + 1, device=q.device, dtype=torch.int32)
    return paged_attention_ref(q, k, v, table, cu, lens, scale)


def cpu_check() -> None:
    """The f16 form against the reference under the interpreter (float32 q; its FP8 dots are the
    GPU's)."""
    q, _, (k8, v8), table, lens = make_case(3, 200, torch.device("cpu"), torch.float32)
    ref = reference(q, k8, v8, table, lens, D ** -0.5)
    got = decode(q, k8, v8, table, lens, "f16", D ** -0.5)
    err = float((got - ref).abs().max())
    print("f16 form vs reference, max abs err", err)
    assert err < 2e-2, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["256x1620", "512x1500", "64x1000"])
    ap.add_argument("--cpu-check", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.cpu_check:
        cpu_check()
        return
    import kernels.paged_attention as pa
    from engine.gemm_tuning import replay_ms
    dev = torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("BENCH_COMMIT", "?"), "cases": []}
    for case in args.cases:
        batch, ctx = (int(x) for x in case.split("x"))
        q, (kb, vb), (k8, v8), table, lens = make_case(batch, ctx, dev, torch.bfloat16)
        scale = D ** -0.5
        cu = torch.arange(batch + 1, device=dev, dtype=torch.int32)
        ref = reference(q, k8, v8, table, lens, scale).float() if batch * ctx <= 300_000 else None
        row = {"case": case, "us": {}, "max_abs_err": {}, "mean_abs_err": {}}
        runs = {f: (lambda f=f: decode(q, k8, v8, table, lens, f, scale)) for f in FORMS}
        runs["bf16"] = lambda: decode(q, kb, vb, table, lens, "f16", scale)
        for name, kc, vc in (("engine_fp8", k8, v8), ("engine_bf16", kb, vb)):
            runs[name] = (lambda kc=kc, vc=vc: pa.paged_attention(
                q, kc, vc, table, cu, lens, scale, max_seqlen_q=1, max_seqlen_k=ctx, num_kv_splits=1,
                merge_in_kernel=True))
        for name, fn in runs.items():
            try:
                us = replay_ms(lambda: [fn() for _ in range(32)], dev) * 1e3 / 32
            except Exception as e:      # a form that does not compile: say so, go on
                row["us"][name] = f"failed: {type(e).__name__}: {str(e)[:300]}"
                print(case, name, "failed", e, flush=True)
                continue
            row["us"][name] = round(us, 2)
            if ref is not None and name not in ("bf16", "engine_bf16"):
                diff = (fn().float() - ref).abs()
                row["max_abs_err"][name] = float(diff.max())
                row["mean_abs_err"][name] = float(diff.mean())
            print(case, name, f"{us:.2f} us", row["max_abs_err"].get(name), flush=True)
        fp8_bytes = 2 * batch * ctx * HKV * D
        row["tb_per_s"] = {n: round((2 if "bf16" in n else 1) * fp8_bytes / (u * 1e-6) / 1e12, 3)
                           for n, u in row["us"].items() if isinstance(u, float)}
        result["cases"].append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
