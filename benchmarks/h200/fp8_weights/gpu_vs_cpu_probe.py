"""Where the FP8 weights path's GPU results part from the CPU reference (tests/test_gpu_engine.py
test_fp8_weights_gpu_engine_near_cpu_engine): one GEMM, then the first step's log-probabilities
(prompt only) and 8 greedy steps, FP8 against the model's dtype, on the tiny llama in fp32.

    PYTHONPATH=. python3 benchmarks/h200/fp8_weights/gpu_vs_cpu_probe.py --out $OUT/probe.json
"""
import argparse
import json
import tempfile

import torch

from engine import LLM, SamplingParams
from engine.models.fp8_linear import quantize_weight
from kernels.fp8_quant import fp8_matmul_ref, quantize_rows
from scripts.make_tiny_model import make_tiny_model
from tests.test_llm import mixed_prompts


def gemm_errors() -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, n, k in [(16, 192, 64), (16, 64, 128), (256, 4096, 4096), (256, 4096, 14336)]:
        x = torch.randn(m, k, device="cuda", generator=gen)
        w8, ws = quantize_weight(torch.randn(n, k, device="cuda", generator=gen) * 0.15)
        q, s = quantize_rows(x)
        want = fp8_matmul_ref(q.double().float(), s, w8, ws)      # fp32 sums, CUDA
        exact = (q.double() @ w8.double().t()) * s.double() * ws.double().t()
        for fast in (False, True):
            got = torch._scaled_mm(q, w8.t(), scale_a=s, scale_b=ws.t(), out_dtype=torch.float32,
                                   use_fast_accum=fast)
            rows.append({"m": m, "n": n, "k": k, "fast_accum": fast,
                         "max_rel_err_vs_exact": ((got.double() - exact).abs().max() / exact.abs().max()).item(),
                         "fp32_ref_rel_err_vs_exact": ((want.double() - exact).abs().max() / exact.abs().max()).item()})
            print(rows[-1], flush=True)
    return rows


def logprob_diffs(model: str, quantization, max_tokens: int) -> dict:
    prompts = [p[:16] for p in mixed_prompts(1024, n=8, seed=3)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    settings = dict(dtype="float32", quantization=quantization, num_kv_blocks=64, max_num_seqs=16)
    outs = {dev: LLM(model, device=dev, **settings).generate(prompts, params) for dev in ("cpu", "cuda")}
    per_step: dict[int, float] = {}
    for c, g in zip(outs["cpu"], outs["cuda"]):
        c, g = c.outputs[0], g.outputs[0]
        for step, (tc, tg) in enumerate(zip(c.token_ids, g.token_ids)):
            lc, lg = c.logprobs[step], g.logprobs[step]
            d = max([0.0] + [abs(lc[t].logprob - lg[t].logprob) for t in lc if t in lg])
            per_step[step] = max(per_step.get(step, 0.0), d)
            if tc != tg:
                break
    return {"quantization": quantization, "max_tokens": max_tokens, "worst_by_step": per_step}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = {"gemm": gemm_errors()}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(f"{tmp}/llama", arch="llama", seed=1))
        out["engine"] = [logprob_diffs(model, q, t) for q in (None, "fp8") for t in (1, 8)]
    for r in out["engine"]:
        print(r, flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
