"""Can one batch's decode attention (bound by HBM) run beside another batch's projections (bound
by math) if the GEMMs leave some SMs free? (issues 12 and 13)

scripts/gpu_overlap_probe.py found two streams worth 1-3%: each kernel fills every SM while it
runs (cuBLAS's Hopper GEMMs are persistent, one block an SM), so the two take turns. Here the
GEMMs are told to leave `carveout` SMs alone (torch._C._set_sm_carveout_experimental, cuBLASLt's
SM count target), which the attention's blocks can then hold while the GEMMs run.

Llama-3.1-8B's shapes, bf16, 32 layers in a CUDA graph. A pair ATTN:GEMM is --context tokens of
decode attention for ATTN rows (kernels/paged_attention.py) and the four projections for GEMM
rows (a prompt chunk when GEMM is large: prefill beside decode; a second micro-batch when it
equals ATTN: two micro-batches of one decode step). For each pair, ms per replay:

  attention      the attention alone (all SMs)
  gemms          the projections alone, at the carveout
  serial         one after the other, layer by layer, on one stream (the projections with all SMs)
  streams        on two streams, forked at the start and joined at the end (independent batches)

`gain` is serial / streams: above 1, running the two batches side by side beats running them
in turn. Each (pair, carveout) row also gives the HBM floor of its bytes.

    PYTHONPATH=. python3 scripts/gpu_overlap_carveout.py --out $OUT/overlap_carveout.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_common import positive_ints  # noqa: E402
from scripts.gpu_overlap_probe import D, HKV, LAYERS, PROJECTIONS, decode_layers  # noqa: E402
COPY_BYTES_PER_S = 4.28e12      # the H200's measured device copy


def parse_pair(text: str) -> tuple[int, int]:
    """'256:2048' -> (attention rows, GEMM rows)."""
    return positive_ints(text, "a pair", "ATTN_ROWS:GEMM_ROWS", "256:2048", sep=":")


def bytes_floor_ms(attn_rows: int, gemm_rows: int, context: int) -> float:
    """The pair's HBM bytes (K/V read once, weights read once, activations ignored) at copy speed."""
    kv = LAYERS * attn_rows * context * HKV * D * 2 * 2
    weights = LAYERS * sum(n * k for n, k in PROJECTIONS) * 2
    return (kv + weights) / COPY_BYTES_PER_S * 1e3


def gemm_flops(gemm_rows: int) -> int:
    return LAYERS * 2 * gemm_rows * sum(n * k for n, k in PROJECTIONS)


def summarize(row: dict) -> dict:
    """gain = serial / streams (the side-by-side run against the same work in turn)."""
    return dict(row, gain=row["serial_ms"] / row["streams_ms"])


def main() -> None:
    import torch

    from engine.gemm_tuning import replay_ms

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=parse_pair, nargs="+", default=[(256, 2048), (256, 8192), (128, 128)])
    ap.add_argument("--carveouts", type=int, nargs="+", default=[0, 16, 32, 48, 66])
    ap.add_argument("--context", type=int, default=1620)
    ap.add_argument("--blas", default="cublaslt", choices=["cublas", "cublaslt"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.backends.cuda.preferred_blas_library(args.blas)
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    w = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for n, k in PROJECTIONS]
    results = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("BENCH_COMMIT", "?"),
               "command": "python3 scripts/gpu_overlap_carveout.py " + " ".join(sys.argv[1:]),
               "context": args.context, "blas": args.blas,
               "num_sms": torch.cuda.get_device_properties(dev).multi_processor_count, "runs": []}
    side = torch.cuda.Stream()
    for attn_rows, gemm_rows in args.pairs:
        attn_layer, gemm_layer = decode_layers(attn_rows, gemm_rows, args.context, w)

        def streams():
            main_stream = torch.cuda.current_stream()
            side.wait_stream(main_stream)
            with torch.cuda.stream(side):
                for _ in range(LAYERS):
                    gemm_layer()
            for _ in range(LAYERS):
                attn_layer()
            main_stream.wait_stream(side)

        torch._C._set_sm_carveout_experimental(None)
        attention_ms = replay_ms(lambda: [attn_layer() for _ in range(LAYERS)], dev)
        gemms_full_ms = replay_ms(lambda: [gemm_layer() for _ in range(LAYERS)], dev)
        serial_ms = replay_ms(lambda: [(attn_layer(), gemm_layer()) for _ in range(LAYERS)], dev)
        for carveout in args.carveouts:
            torch._C._set_sm_carveout_experimental(carveout or None)
            gemms_ms = replay_ms(lambda: [gemm_layer() for _ in range(LAYERS)], dev)
            row = summarize({
                "attn_rows": attn_rows, "gemm_rows": gemm_rows, "carveout": carveout,
                "attention_ms": attention_ms, "gemms_full_ms": gemms_full_ms, "gemms_ms": gemms_ms,
                "gemm_tflops": gemm_flops(gemm_rows) / gemms_ms / 1e9,
                "serial_ms": serial_ms, "streams_ms": replay_ms(streams, dev),
                "bytes_floor_ms": bytes_floor_ms(attn_rows, gemm_rows, args.context)})
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
        torch._C._set_sm_carveout_experimental(None)
        del attn_layer, gemm_layer
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
