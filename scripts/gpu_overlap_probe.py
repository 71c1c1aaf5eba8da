"""Can a large decode step's attention (bound by HBM) and its projections (bound by math) run at
the same time on one GPU? (issue 13: 1000 x 1000 needs them overlapped, large_batch_decode_d4084f2.md)

Llama-3.1-8B's shapes, bf16, decode rows at --context tokens each. Two micro-batches of --rows
rows each: A's attention (kernels/paged_attention.py, 32 calls, one per layer) and B's
projections (cuBLAS: qkv, o_proj, gate_up, down, 32 layers), captured in CUDA graphs:

  attention      A's 32 attention calls alone
  gemms          B's 32 layers of projections alone
  both_serial    the two one after the other on one stream
  both_streams   on two streams, forked at the start and joined at the end
  both_layers    on two streams, joined after every layer (what a two-micro-batch step needs:
                 layer i's attention of one batch beside layer i's projections of the other)

If both_layers is well under both_serial, splitting a step into two micro-batches on two
streams pays; the price is reading the weights once per micro-batch.

    PYTHONPATH=. python3 scripts/gpu_overlap_probe.py --out $OUT/overlap.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.paged_attention import paged_attention  # noqa: E402
from engine.gemm_tuning import replay_ms  # noqa: E402
from scripts.bench_common import PRESETS  # noqa: E402
from scripts.gpu_gemm_rate import layer_shapes  # noqa: E402

H, I, HQ, HKV, D, LAYERS, BLOCK = 4096, 14336, 32, 8, 128, 32, 16
# (N, K) of qkv, o_proj, gate_up and down at Llama-3.1-8B's shapes
PROJECTIONS = list(layer_shapes(PRESETS["llama-3.1-8b"]).values())


def decode_layers(attn_rows: int, gemm_rows: int, context: int, weights: list):
    """(attention, projections) of one layer as closures: paged attention of attn_rows decode rows
    at `context` keys each over scattered 16-key pages, and the four projections (`weights`:
    qkv, o_proj, gate_up, down) of gemm_rows rows. The cache lives as long as the closures."""
    dev, dt = weights[0].device, weights[0].dtype
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = attn_rows * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_blocks, device=dev, dtype=torch.int32).view(attn_rows, blocks_per_seq)
    cu = torch.arange(attn_rows + 1, device=dev, dtype=torch.int32)
    lens = torch.full((attn_rows,), context, device=dev, dtype=torch.int32)
    q = torch.randn(attn_rows, HQ, D, device=dev, dtype=dt)
    x = torch.randn(gemm_rows, H, device=dev, dtype=dt)
    act = torch.randn(gemm_rows, I, device=dev, dtype=dt)

    def attn_layer():
        paged_attention(q, k_cache, v_cache, table, cu, lens, D ** -0.5, max_seqlen_q=1,
                        max_seqlen_k=context, merge_in_kernel=True)

    def gemm_layer():
        F.linear(x, weights[0])
        F.linear(x, weights[1])
        F.linear(x, weights[2])
        F.linear(act, weights[3])
    return attn_layer, gemm_layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 208, 256])
    ap.add_argument("--context", type=int, default=1620)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    w = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for n, k in PROJECTIONS]
    results = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("BENCH_COMMIT", "?"),
               "context": args.context, "runs": []}
    for rows in args.rows:
        attn_layer, gemm_layer = decode_layers(rows, rows, args.context, w)
        side = torch.cuda.Stream()

        def streams(join_every_layer: bool):
            def body():
                main_stream = torch.cuda.current_stream()
                side.wait_stream(main_stream)
                for _ in range(LAYERS):
                    attn_layer()
                    with torch.cuda.stream(side):
                        gemm_layer()
                    if join_every_layer:
                        main_stream.wait_stream(side)
                        side.wait_stream(main_stream)
                main_stream.wait_stream(side)
            return body

        row = {"rows": rows,
               "attention_ms": replay_ms(lambda: [attn_layer() for _ in range(LAYERS)], dev),
               "gemms_ms": replay_ms(lambda: [gemm_layer() for _ in range(LAYERS)], dev),
               "both_serial_ms": replay_ms(lambda: [(attn_layer(), gemm_layer()) for _ in range(LAYERS)], dev),
               "both_streams_ms": replay_ms(streams(False), dev),
               "both_layers_ms": replay_ms(streams(True), dev)}
        kv_bytes = LAYERS * rows * args.context * HKV * D * 2 * 2
        w_bytes = LAYERS * sum(t.numel() for t in w) * 2
        row["bytes_floor_ms"] = (kv_bytes + w_bytes) / 4.28e12 * 1e3
        results["runs"].append(row)
        print(json.dumps(row), flush=True)
        del attn_layer, gemm_layer
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
