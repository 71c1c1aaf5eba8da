"""Where the FP8 weights path's GPU results part from the CPU reference (tests/test_gpu_engine.py
test_fp8_weights_gpu_engine_near_cpu_engine): one GEMM, then the first step's log-probabilities
(prompt only) and 8 greedy steps, FP8 against the model's dtype, on the tiny llama in fp32.

    PYTHONPATH=. python3 benchmarks/h200/fp8_weights/gpu_vs_cpu_probe.py --out $OUT/probe.json

--cpu-noise (no GPU): how far the tiny model carries small errors in the projections' products,
on the CPU: the FP8 engine's first-step top-5 log-probabilities with each product multiplied by
(1 + noise x N(0, 1)), against none, for noise 1e-6 .. 2e-4 (the tensor cores' error above).
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


def first_step_logprobs(model: str, prompts: list[list[int]]) -> list[dict]:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5)
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, quantization="fp8")
    return [o.outputs[0].logprobs[0] for o in llm.generate(prompts, params)]


def cpu_noise(model: str) -> list[dict]:
    import engine.models.fp8_linear as fp8_linear
    prompts = [p[:16] for p in mixed_prompts(1024, n=8, seed=3)]
    base = first_step_logprobs(model, prompts)
    rows = []
    for noise in (1e-6, 1e-5, 1e-4, 2e-4):
        gen = torch.Generator().manual_seed(1)

        def noisy(q, s, w, ws, noise=noise, gen=gen):
            y = fp8_matmul_ref(q, s, w, ws)
            return y * (1 + noise * torch.randn(y.shape, generator=gen))
        fp8_linear.fp8_matmul_ref = noisy
        try:
            got = first_step_logprobs(model, prompts)
        finally:
            fp8_linear.fp8_matmul_ref = fp8_matmul_ref
        worst = max(abs(a[t].logprob - b[t].logprob) for a, b in zip(base, got) for t in a if t in b)
        rows.append({"relative_noise": noise, "worst_first_step_logprob_diff": worst})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-noise", action="store_true", help="the CPU experiment only (docstring)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.cpu_noise:
        with tempfile.TemporaryDirectory() as tmp:
            model = str(make_tiny_model(f"{tmp}/llama", arch="llama", seed=1))
            out = {"cpu_noise": cpu_noise(model)}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        return
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
