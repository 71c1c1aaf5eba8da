"""Does cuBLAS run a projection faster cut into pieces? (issue 13)

At 8,192 rows (a prompt step) cuBLAS runs gate_up_proj at ~690 TFLOP/s where qkv_proj and
o_proj reach ~808 (open_targets_bounds.md section 1); at 256 rows (a decode step) every
projection runs at 524-647 TFLOP/s, at 512 rows 695-754 (gemm_rate_3724bbd.json). The shape
cuBLAS is given may be what costs: its tiles fill the SMs badly at M = 256, and a long
N = 28,672 output may be walked in an order that reads its operands from HBM more than needed.

Forms of one projection y = x W^T, W [N, K], each the same product (its bits equal one call's
unless the kernel picked for a piece splits K differently: `bitwise_equal_full`, `max_diff`):
  full          torch.mm(x, W.T, out=y), what F.linear runs
  n<P>          P column blocks: torch.mm(x, W[j].T, out=y[:, j]) into the one [M, N] output
  m<C>          row blocks of C rows: torch.mm(x[r], W.T, out=y[r])
  grouped       torch._grouped_mm (CUTLASS's sm90 grouped GEMM, another kernel family than
                cuBLAS's) with one group; it returns its own tensor, which the check compares
  k<S>          K split in S as one batched GEMM over views of x and W (no copies): S float32
                partials [S, M, N] (torch.bmm's out_dtype), summed and rounded into y. S times
                the tiles of `full` for the shapes whose tiles fill the SMs badly (split-K by hand)
  k<S>h         the same with bf16 partials, summed into y (rounds twice)
  k<S>raw       the batched GEMM alone, returning the float32 partials: what k<S> would cost
                with the sum folded into the kernel that reads y next (residual add, SiLU-and-mul,
                rotary); the check sums them

Each form runs in a CUDA graph over 32 layers' own weights (HBM, as gpu_gemm_rate.py), median
of a few replays, us a layer; `layer` rows chain the four projections layer by layer, each in
the form given, as a step runs them (the GPU's clocks under a whole step's load).

    python3 scripts/gpu_gemm_forms.py --out $OUT/gemm_forms.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.gemm_tuning import replay_ms  # noqa: E402
from scripts.bench_common import PRESETS, git_commit, hardware  # noqa: E402
from scripts.gpu_gemm_rate import layer_shapes  # noqa: E402


def split_k_views(x: torch.Tensor, w: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] and W [N, K] as [S, M, K/S] and [S, K/S, N] views, batch s holding K's s-th
    slice: strided-batched operands cuBLAS takes as they are."""
    (m, k), n = x.shape, w.shape[0]
    if k % parts:
        raise ValueError(f"K = {k} does not split in {parts}")
    return (x.view(m, parts, k // parts).transpose(0, 1),
            w.view(n, parts, k // parts).permute(1, 0, 2).transpose(1, 2))


def run_form(form: str, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y = x w^T in the given form (module docstring); returns the result (y, save for grouped
    and k<S>raw)."""
    split = re.fullmatch(r"k(\d+)(h|raw)?", form)
    if split:
        xs, ws = split_k_views(x, w, int(split.group(1)))
        if split.group(2) == "h":
            torch.sum(torch.bmm(xs, ws), 0, out=y)
            return y
        if x.is_cuda:
            partials = torch.bmm(xs, ws, out_dtype=torch.float32)
        else:                   # bmm's out_dtype is CUDA's only; the CPU check runs in float32
            partials = torch.bmm(xs.float(), ws.float())
        if split.group(2) == "raw":
            return partials
        y.copy_(partials.sum(0))
        return y
    if form == "grouped":
        return torch._grouped_mm(x.unsqueeze(0), w.t().unsqueeze(0))[0]
    if form == "full":
        torch.mm(x, w.t(), out=y)
    elif form.startswith("n"):
        parts = int(form[1:])
        n = w.shape[0]
        step = -(-n // parts)
        step = -(-step // 128) * 128
        for j in range(0, n, step):
            torch.mm(x, w[j:j + step].t(), out=y[:, j:j + step])
    elif form.startswith("m"):
        chunk = int(form[1:])
        for r in range(0, x.shape[0], chunk):
            torch.mm(x[r:r + chunk], w.t(), out=y[r:r + chunk])
    else:
        raise ValueError(form)
    return y


def kernel_names(body) -> list[str]:
    """The GPU kernels one call of body() launches (cuBLAS's names give its tile and split-K)."""
    body()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        body()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 384, 512, 8192])
    ap.add_argument("--forms", nargs="+", default=["full", "n2", "n3", "n4", "n7", "m128", "m512", "m1024",
                                                   "m2048", "m4096"])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = PRESETS["llama-3.1-8b"]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = layer_shapes(cfg)
    weights = {name: [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
                      for _ in range(args.layers)] for name, (n, k) in shapes.items()}
    results = []

    def record(row):
        results.append(row)
        print(json.dumps(row), flush=True)

    for rows in args.rows:
        forms = [f for f in args.forms if not (f.startswith("m") and int(f[1:]) >= rows)]
        xs = {name: torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=gen)
              for name, (n, k) in shapes.items()}
        ys = {name: torch.empty(rows, n, device=dev, dtype=torch.bfloat16) for name, (n, k) in shapes.items()}
        best, best_fused = {}, {}
        for name, (n, k) in shapes.items():
            x, y = xs[name], ys[name]
            ref = F.linear(x, weights[name][0])
            times = {}
            for form in forms:
                y.zero_()
                got = run_form(form, x, weights[name][0], y)
                if got.dim() == 3:                  # k<S>raw's partials
                    got = got.sum(0).to(ref.dtype)
                same = bool(torch.equal(got, ref))
                max_diff = (got.float() - ref.float()).abs().max().item()
                us = replay_ms(lambda: [run_form(form, x, w, y) for w in weights[name]], dev) * 1e3 / args.layers
                times[form] = us
                record({"rows": rows, "proj": name, "n": n, "k": k, "form": form, "us": us,
                        "tflops": 2 * rows * n * k / us / 1e6, "bitwise_equal_full": same,
                        "max_diff": max_diff,
                        "kernels": kernel_names(lambda: run_form(form, x, weights[name][0], y))})
            best[name] = min((f for f in times if not f.endswith("raw")), key=times.get)
            best_fused[name] = min(times, key=times.get)

        def chain(choice):
            for layer in range(args.layers):
                for name in shapes:
                    run_form(choice[name], xs[name], weights[name][layer], ys[name])

        flops = 2 * rows * sum(n * k for n, k in shapes.values())
        for label, choice in (("full", {name: "full" for name in shapes}), ("best", best),
                              ("best_sum_folded", best_fused)):
            us = replay_ms(lambda: chain(choice), dev) * 1e3 / args.layers
            record({"rows": rows, "proj": "layer", "form": label, "choice": choice, "us": us,
                    "tflops": flops / us / 1e6})
        del xs, ys
        torch.cuda.empty_cache()
    out = {"meta": {"hardware": hardware(), "commit": os.environ.get("BENCH_COMMIT") or git_commit(),
                    "command": "python3 scripts/gpu_gemm_forms.py " + " ".join(sys.argv[1:])},
           "results": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
