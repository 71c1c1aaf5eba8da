"""Paged attention over an FP8 KV cache (EngineConfig.kv_cache_dtype="fp8") against the same
calls over a bf16 cache, on a GPU, at Llama-3.1-8B shapes (Hq 32, Hkv 8, D 128, 16-key pages):
us per call (a CUDA graph of 32 calls), for the tile config the kernel picks and for others
given with --decode-configs / --prompt-configs (BLOCK_Q/BLOCK_N/warps/stages) and decode key
loops given with --loops, so the FP8 configs can be chosen by measurement. Decode cases run as the engine's decode graphs do (splits merged in the kernel);
prompt cases are one prompt of that many tokens, computed whole. Each FP8 output is compared
with the reference on the same FP8 cache.

    PYTHONPATH=. python3 scripts/gpu_fp8_attention.py --out $OUT/fp8_attention.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels.paged_attention as pa  # noqa: E402
from engine.gemm_tuning import replay_ms  # noqa: E402
from kernels.attention_ref import paged_attention_ref, to_cache_dtype  # noqa: E402

HQ, HKV, D, BLOCK, LAYERS = 32, 8, 128, 16, 32
DECODE_CONFIGS = ["16/64/4/3", "16/128/4/3", "16/128/4/4", "16/128/8/3", "16/256/4/3", "16/256/8/2"]
PROMPT_CONFIGS = ["128/64/8/3", "128/128/8/3", "128/64/8/4", "64/64/4/3"]


def _config(text: str) -> pa._TileConfig:
    return pa._TileConfig(*(int(v) for v in text.split("/")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["256x1620", "64x1000", "1x1000", "prompt2048"],
                    help="BATCHxCONTEXT decode rows, or promptN")
    ap.add_argument("--decode-configs", nargs="*", default=DECODE_CONFIGS)
    ap.add_argument("--prompt-configs", nargs="*", default=PROMPT_CONFIGS)
    ap.add_argument("--loops", nargs="*", default=["prompt", "i32", "prompt_i32"],
                    help="decode cases: key loops to try beside the rule's (prompt: the prompt tiles' "
                         "loop; i32: int32 offsets)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, dt, fp8 = torch.device("cuda"), torch.bfloat16, torch.float8_e4m3fn
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("BENCH_COMMIT", "?"), "cases": []}
    picked = pa._pick_config
    for case in args.cases:
        if case.startswith("prompt"):
            batch, ctx, q_len = 1, int(case[6:]), int(case[6:])
            configs = args.prompt_configs
        else:
            batch, ctx = (int(v) for v in case.split("x"))
            q_len = 1
            configs = args.decode_configs
        per_seq = -(-ctx // BLOCK)
        layers = LAYERS if batch * ctx <= 64 * 1000 else 1       # big caches: one, read 32 times
        g = torch.Generator(device=dev).manual_seed(0)
        caches = {dt: [(torch.randn(batch * per_seq, BLOCK, HKV, D, device=dev, dtype=dt, generator=g),
                        torch.randn(batch * per_seq, BLOCK, HKV, D, device=dev, dtype=dt, generator=g))
                       for _ in range(layers)]}
        caches[fp8] = [(to_cache_dtype(k, fp8), to_cache_dtype(v, fp8)) for k, v in caches[dt]]
        table = torch.randperm(batch * per_seq, device=dev, dtype=torch.int32).view(batch, per_seq)
        cu = torch.arange(batch + 1, device=dev, dtype=torch.int32) * q_len
        lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
        q = torch.randn(batch * q_len, HQ, D, device=dev, dtype=dt)
        splits = pa.choose_fused_kv_splits(batch, HKV, ctx, num_sms) if q_len == 1 else 1
        row = {"case": case, "splits": splits, "us": {}, "max_abs_err_vs_ref": {}}
        k_ref, v_ref = caches[fp8][0]
        ref = paged_attention_ref(q, k_ref, v_ref, table, cu, lens, D ** -0.5) if batch * ctx <= 300_000 else None

        def timed(kv_dtype, cfg_text=None, loop=None):
            pa._pick_config = picked if cfg_text is None else (lambda *a, **k: _config(cfg_text))
            prompt_loop, i32 = {None: (None, None), "prompt": (True, False), "i32": (None, True),
                                "prompt_i32": (True, True)}[loop]
            try:
                def call(i):
                    k, v = caches[kv_dtype][i % layers]
                    return pa.paged_attention(q, k, v, table, cu, lens, D ** -0.5, max_seqlen_q=q_len,
                                              max_seqlen_k=ctx, num_kv_splits=splits if q_len == 1 else None,
                                              merge_in_kernel=q_len == 1, prompt_loop=prompt_loop,
                                              i32_offsets=i32)
                us = replay_ms(lambda: [call(i) for i in range(LAYERS)], dev) * 1e3 / LAYERS
                got = call(0)
            finally:
                pa._pick_config = picked
            name = f"{'fp8' if kv_dtype == fp8 else 'bf16'}_{cfg_text or 'picked'}" + (f"_{loop}" if loop else "")
            row["us"][name] = round(us, 2)
            if kv_dtype == fp8 and ref is not None:
                row["max_abs_err_vs_ref"][name] = float((got.float() - ref.float()).abs().max())
            print(case, name, f"{us:.2f} us", flush=True)

        timed(dt)
        timed(fp8)
        for cfg_text in configs:
            for loop in [None] + (args.loops if q_len == 1 else []):
                try:
                    timed(fp8, cfg_text, loop)
                except Exception as e:      # a config that does not compile or fit: say so, go on
                    row["us"][f"fp8_{cfg_text}_{loop}"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                    print(case, cfg_text, loop, "failed", e, flush=True)
        if q_len == 1:
            for loop in args.loops:
                timed(dt, None, loop)
        kv_bytes = 2 * batch * ctx * HKV * D
        row["bf16_tb_per_s"] = round(2 * kv_bytes / (row["us"]["bf16_picked"] * 1e-6) / 1e12, 3)
        row["fp8_tb_per_s"] = round(kv_bytes / (row["us"]["fp8_picked"] * 1e-6) / 1e12, 3)
        out["cases"].append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
