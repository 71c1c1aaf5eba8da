"""The skinny GEMM's swap-AB tiling past 16 rows (issue 13), on a GPU: does it beat cuBLAS at
32-256 rows?

At 128 rows Llama-3.1-8B's decode projections are bound by their weight bytes, not by compute
(128 FLOP a byte against the H200's ~200), yet cuBLAS streams them at 2.4-3.5 TB/s
(gemm_rate_blas_af6f139.json: o_proj 14.3 us for 33.6 MB) against the device copy's 4.28.
kernels/skinny_gemm.py is shaped around the weight stream: W's rows on the MMA's tall side, x's
rows on its narrow side (a wgmma's N, up to 256), K split until every SM has programs. Its
wrapper stops at 16 rows; this calls its kernel with BLOCK_M = the rows rounded up to a power of
two, so the same code answers for 32-256 rows.

Per projection and row count, us a call in a CUDA graph over 32 layers' own weights (HBM, as a
decode step reads them), the median of a few replays:

  cublas     F.linear
  merged     the kernel with its split-K merge by the last program (y written, x's dtype)
  unmerged   the same programs, each storing its fp32 partial (what the late-merge path hands on)

for a grid of tiles and split counts; every config that compiles (shared memory) is timed, and
one result per row count is checked against F.linear. Wider W tiles (--tiles 256,64,8,4) read
x from L2 fewer times: x [rows, K] is loaded once per W tile, so at 128 rows and 64-row W tiles
the programs read twice as many bytes of x (from L2) as of W (from HBM).

    PYTHONPATH=. python3 scripts/gpu_wide_skinny.py --out $OUT/wide_skinny.json
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels.skinny_gemm as sg  # noqa: E402 - the root is on the path now

LAYERS = 32
SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}
# (block_n, block_k, num_warps, num_stages)
TILES = ((64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (128, 64, 4, 4), (128, 64, 8, 4), (128, 128, 8, 3),
         (64, 64, 4, 6), (128, 64, 8, 5))
PER_SM = (1, 2, 4)


def block_m(rows: int) -> int:
    """The MMA's narrow side for `rows` x rows: a power of two, at least 16."""
    return max(16, 1 << (rows - 1).bit_length())


def configs(n: int, k: int, num_sms: int, tiles=TILES) -> list[tuple[int, int, int, int, int]]:
    """(block_n, block_k, warps, stages, split) for every tile and programs-an-SM target."""
    out = []
    for bn, bk, w, st in tiles:
        for per_sm in PER_SM:
            c = (bn, bk, w, st, sg._split(n, k, bn, bk, num_sms, per_sm))
            if c not in out:
                out.append(c)
    return out


def main() -> None:
    import torch
    import torch.nn.functional as F
    import triton

    from engine.gemm_tuning import replay_ms
    from kernels.arrival_counters import arrival_counters
    from scripts.bench_common import write_probe

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--projections", nargs="+", default=list(SHAPES))
    ap.add_argument("--tiles", nargs="+", metavar="BN,BK,WARPS,STAGES", default=None,
                    help="tiles to try instead of TILES")
    args = ap.parse_args()
    tiles_tried = TILES if args.tiles is None else tuple(tuple(int(v) for v in t.split(",")) for t in args.tiles)
    dev, dt = torch.device("cuda"), torch.bfloat16
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows_out = []

    def us(body) -> float:
        return replay_ms(body, dev, 9) * 1e3 / LAYERS

    for name in args.projections:
        n, k = SHAPES[name]
        ws = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(LAYERS)]
        for rows in args.rows:
            bm = block_m(rows)
            x = torch.randn(rows, k, device=dev, dtype=dt)
            y = torch.empty(rows, n, device=dev, dtype=dt)
            ref = F.linear(x, ws[0]).float()
            row = {"proj": name, "n": n, "k": k, "rows": rows, "block_m": bm, "weight_mb": n * k * 2 / 1e6,
                   "cublas_us": us(lambda: [F.linear(x, w) for w in ws]), "configs": {}}
            for bn, bk, warps, stages, split in configs(n, k, num_sms, tiles_tried):
                per, slices = sg._k_slices(k, sg.SkinnyConfig(bn, bk, split))
                tiles = triton.cdiv(n, bn)
                part = torch.empty(slices, tiles * bn, bm, device=dev, dtype=torch.float32)
                parts = torch.empty(slices, rows, n, device=dev, dtype=torch.float32)
                counters = arrival_counters("wide_skinny_probe", dev, tiles)

                def launch(w, unmerged: bool):
                    sg._skinny_gemm_kernel[(tiles, slices)](
                        x, w, w, parts if unmerged else y, parts if unmerged else part, counters,
                        rows, n, k, per, slices, x.stride(0), w.stride(0), y.stride(0),
                        HAS_BIAS=False, SILU_MUL=False, HAS_SPLITS=slices > 1, EVEN_K=k % bk == 0,
                        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION="tf32", USE_PDL=False,
                        SPLIT_OUT=unmerged, num_warps=warps, num_stages=stages)
                key = f"n{bn}k{bk}s{split}w{warps}st{stages}"
                try:
                    launch(ws[0], False)
                    torch.cuda.synchronize()
                except Exception as e:      # shared memory past the SM's: not a config for this row count
                    row["configs"][key] = {"error": type(e).__name__}
                    continue
                err = (y.float() - ref).abs().max().item()
                launch(ws[0], True)
                err_parts = (parts.sum(0) - ref).abs().max().item()
                row["configs"][key] = {
                    "programs": tiles * slices, "slices": slices, "max_err": err, "max_err_unmerged": err_parts,
                    "merged_us": us(lambda: [launch(w, False) for w in ws]),
                    "unmerged_us": us(lambda: [launch(w, True) for w in ws])}
            timed = {c: r for c, r in row["configs"].items() if "merged_us" in r}
            best = min(timed, key=lambda c: timed[c]["merged_us"])
            best_u = min(timed, key=lambda c: timed[c]["unmerged_us"])
            row.update(best=best, best_us=timed[best]["merged_us"], best_unmerged=best_u,
                       best_unmerged_us=timed[best_u]["unmerged_us"],
                       cublas_tb_s=row["weight_mb"] / row["cublas_us"],
                       best_tb_s=row["weight_mb"] / timed[best]["merged_us"])
            rows_out.append(row)
            print(f"{name} rows {rows}: cuBLAS {row['cublas_us']:.1f} us ({row['cublas_tb_s']:.2f} TB/s), "
                  f"best {best} {row['best_us']:.1f} us ({row['best_tb_s']:.2f} TB/s, err "
                  f"{timed[best]['max_err']:.3g}), unmerged {best_u} {row['best_unmerged_us']:.1f}", flush=True)
            write_probe(args.out, rows_out, command=" ".join(sys.argv))
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
