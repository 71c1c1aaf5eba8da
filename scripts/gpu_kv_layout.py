"""Paged attention over a token-major KV cache [blocks, page, Hkv, D] (the engine's) against a
head-major one [blocks, Hkv, page, D] seen through the same logical view (issue 13; the kernels
take strides, so only the strides differ). Same values in both; the two run alternately, 3
rounds, L2 flushed (scripts/gpu_check_attention.bench_ms); outputs compared bitwise.

    PYTHONPATH=. python3 scripts/gpu_kv_layout.py      # writes $OUT (or .)/kv_layout_<commit>.json
"""
import json, os, statistics, sys
import torch, triton
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels.paged_attention import paged_attention
from scripts.bench_common import git_commit
from scripts.gpu_check_attention import HQ, HKV, D, BLOCK, DTYPE, bench_ms
if not torch.cuda.is_available():
    raise SystemExit("needs a CUDA GPU")
torch.manual_seed(0)
TOKENS = 256 * 1700 + 70000
nb = triton.cdiv(TOKENS, BLOCK) + 64
k_tok = torch.randn(nb, BLOCK, HKV, D, device="cuda", dtype=DTYPE)
v_tok = torch.randn(nb, BLOCK, HKV, D, device="cuda", dtype=DTYPE)
k_head = k_tok.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
v_head = v_tok.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
assert torch.equal(k_head, k_tok) and k_head.stride() != k_tok.stride()
flush = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
CASES = [("decode 256 x 1620", [1] * 256, [1620] * 256), ("decode 64 x 1000", [1] * 64, [1000] * 64),
         ("decode 16 x 1000", [1] * 16, [1000] * 16), ("decode 1 x 4000", [1], [4000]), ("decode 1 x 300", [1], [300]),
         ("prefill 2048 x2", [2048] * 2, [2048] * 2), ("prefill 16 x 200 after 2000", [200] * 16, [2200] * 16)]
rows = []
for name, q_lens, ctx in CASES:
    need = [triton.cdiv(n, BLOCK) for n in ctx]
    ids = torch.randperm(nb, device="cuda")[:sum(need)].to(torch.int32)
    table = torch.zeros(len(ctx), max(need), dtype=torch.int32, device="cuda")
    off = 0
    for b, n in enumerate(need):
        table[b, :n] = ids[off:off + n]; off += n
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32); cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    q = torch.randn(int(cu[-1]), HQ, D, device="cuda", dtype=DTYPE)
    cu, sl = cu.cuda(), torch.tensor(ctx, dtype=torch.int32, device="cuda")
    outs, times = {}, {"token_major": [], "head_major": []}
    for rnd in range(3):
        for lay, (k, v) in (("token_major", (k_tok, v_tok)), ("head_major", (k_head, v_head)))[::(1 if rnd % 2 else -1)]:
            fn = lambda: paged_attention(q, k, v, table, cu, sl, D ** -0.5, None, max_seqlen_q=max(q_lens), max_seqlen_k=max(ctx))
            outs[lay] = fn()
            times[lay].append(bench_ms(fn, 5, 30, flush))
    kv_bytes = sum(ctx) * HKV * D * 2 * 2
    r = {"case": name, **{f"{l}_us": 1e3 * statistics.median(t) for l, t in times.items()},
         "bitwise_equal": bool(torch.equal(outs["token_major"], outs["head_major"]))}
    r["token_major_TB_s"] = kv_bytes / r["token_major_us"] / 1e6
    r["head_major_TB_s"] = kv_bytes / r["head_major_us"] / 1e6
    rows.append(r)
    print(f"{name:32s} token-major {r['token_major_us']:8.1f} us ({r['token_major_TB_s']:.2f} TB/s)  "
          f"head-major {r['head_major_us']:8.1f} us ({r['head_major_TB_s']:.2f} TB/s)  equal {r['bitwise_equal']}", flush=True)
out = os.environ.get("OUT", ".")
json.dump({"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "rows": rows},
          open(os.path.join(out, f"kv_layout_{git_commit()}.json"), "w"), indent=1)
