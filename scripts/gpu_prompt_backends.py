"""Prompt attention: our paged kernel against torch's attention backends, on a GPU (issues 12, 13).

Our prompt tiles run at ~335 TFLOP/s (FlashAttention-2's structure, benchmarks/h200/
ncu_attention_and_rows.md); torch's SDPA reached 609-631 on contiguous data
(decode_forms/ws_attention_f5ea94b.json). Prompt attention is ~5 s of the RFC job's groups mode.
Would a step gain by handing its prompt rows to one of torch's kernels? They need the keys
contiguous, so the gather from the paged cache is timed too.

Llama-3.1-8B's attention shapes (Hq 32, Hkv 8, D 128, 16-key pages, bf16). Per case, us per
call (L2 flushed) and TFLOP/s of the causal (query, key) pairs:

  paged          kernels/paged_attention.py as the engine runs a prompt step
  gather         the sequences' keys and values copied out of the paged cache, [total_k, Hkv, D]
  flash_varlen   torch.ops.aten._flash_attention_forward on the gathered keys (cu_seqlens, causal)
  cudnn_varlen   torch.ops.aten._cudnn_attention_forward on the same
  sdpa_<backend> F.scaled_dot_product_attention, dense [B, H, L, D], enable_gqa, where every
                 sequence has one length and no cached keys (is_causal)

Each result's largest difference from `paged` is recorded (a wrong causal alignment shows as a
large one); a call that raises is recorded with its error.

    PYTHONPATH=. python3 scripts/gpu_prompt_backends.py --out $OUT/prompt_backends.json
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (name, [(q_len, seq_len)]): each sequence's new rows are its last q_len positions.
CASES = [
    ("1000x1000 prompt step: 8 fresh x 1000", [(1000, 1000)] * 8),
    ("rfc prompt step: 2200 fresh + 22 x 200 after 2000", [(2200, 2200)] + [(200, 2200)] * 22),
    ("fresh 2048 x4", [(2048, 2048)] * 4),
    ("fresh 8192", [(8192, 8192)]),
    ("chunk 2048 after 6144", [(2048, 8192)]),
]


def main() -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import kernels.paged_attention as pa
    from scripts.bench_common import write_probe
    from scripts.gpu_check_attention import BLOCK, D, HKV, HQ, bench_ms
    from scripts.gpu_check_cascade import Batch
    from scripts.gpu_prompt_tiles import causal_pairs_of

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    flush = torch.empty(80 * 2 ** 20, dtype=torch.uint8, device="cuda")
    scale = D ** -0.5
    rows = []
    for name, seqs in CASES:
        b = Batch([], seqs, seed=5)
        q, k, v, table, cu, lens, _, _ = b.args()
        flops = 4 * HQ * D * causal_pairs_of([], seqs)
        max_q, max_k = b.max_seqlen_q, b.max_seqlen_k
        # Flat cache slots of every sequence's keys, in order: the gather's index.
        slots = torch.cat([(table[i, :(n + BLOCK - 1) // BLOCK].long()[:, None] * BLOCK
                            + torch.arange(BLOCK, device=q.device)).flatten()[:n] for i, (_, n) in enumerate(seqs)])
        k_flat, v_flat = k.view(-1, HKV, D), v.view(-1, HKV, D)
        cu_k = torch.tensor([0] + [n for _, n in seqs], device=q.device).cumsum(0).to(torch.int32)
        kc, vc = k_flat.index_select(0, slots), v_flat.index_select(0, slots)
        uniform = len({s for s in seqs}) == 1 and seqs[0][0] == seqs[0][1]
        calls = {
            "paged": lambda: pa.paged_attention(q, k, v, table, cu, lens, scale, max_seqlen_q=max_q, max_seqlen_k=max_k),
            "gather": lambda: (torch.index_select(k_flat, 0, slots, out=kc), torch.index_select(v_flat, 0, slots, out=vc)),
            "flash_varlen": lambda: torch.ops.aten._flash_attention_forward(
                q, kc, vc, cu, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0],
            "cudnn_varlen": lambda: torch.ops.aten._cudnn_attention_forward(
                q, kc, vc, None, cu, cu_k, max_q, max_k, False, 0.0, True, False, scale=scale)[0],
        }
        if uniform:
            bsz, n = len(seqs), seqs[0][1]
            q4 = q.view(bsz, n, HQ, D).transpose(1, 2)
            k4, v4 = kc.view(bsz, n, HKV, D).transpose(1, 2), vc.view(bsz, n, HKV, D).transpose(1, 2)
            for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
                def sdpa(_b=getattr(SDPBackend, backend)):
                    with sdpa_kernel(_b):
                        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale,
                                                              enable_gqa=True).transpose(1, 2).reshape(q.shape)
                calls["sdpa_" + backend.split("_")[0].lower()] = sdpa
        ref = calls["paged"]().float()
        for kernel, fn in calls.items():
            row = {"case": name, "kernel": kernel, "rows": int(q.shape[0])}
            try:
                out = fn()
                torch.cuda.synchronize()
                row["us"] = 1e3 * bench_ms(fn, 3, 15, flush)
            except Exception as e:  # noqa: BLE001 - a backend that refuses the shape is data
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print(f"{name[:44]:<44} {kernel:<14} error {row['error'][:150]}", flush=True)
                continue
            if kernel != "gather":
                row["max_abs_diff"] = (out.float() - ref).abs().max().item()
                row["tflops"] = flops / row["us"] / 1e6
            rows.append(row)
            print(f"{name[:44]:<44} {kernel:<14} {row['us']:9.1f} us "
                  + (f"{row['tflops']:6.1f} TFLOP/s  diff {row['max_abs_diff']:.3g}" if "tflops" in row else ""),
                  flush=True)
        del b, kc, vc
        torch.cuda.empty_cache()
    write_probe(args.out, rows, command=" ".join(sys.argv))


if __name__ == "__main__":
    main()
