"""What the skinny GEMM's fusions cost and buy in a batch-1 decode step (issue 13), on a GPU.

Llama-3.1-8B's projections (bf16, random weights, 32 layers each so the weights stream from HBM
as in a step), one row. Each kernel is timed as engine/gemm_tuning.py times it (a CUDA graph of
the call over the 32 layers, replayed; us per call), for every candidate config:

  qkv_proj, gate_up_proj  plain; the RMSNorm prologue (kernels/skinny_gemm.py) with its loads a
                          step ahead and without
  o_proj                  plain; the residual-add epilogue
  down_proj               plain; the SiLU-and-mul prologue, ahead and not; SiLU + residual
and the separate kernels the fusions replace (rms_norm with the residual add, silu_and_mul).

Then a decode layer's chain without its attention (so the kernels between the projections are
what differs), 32 layers in one graph with PDL, each projection at its best config:
  apart   rms_norm(+res), qkv, o_proj, rms_norm(+res), gate_up, silu_and_mul, down  (the default)
  fused   qkv(norm), o_proj(+res, sums), gate_up(norm), down(silu, +res, sums)
us per layer; the difference is what the fusions take off a step, per layer.

    PYTHONPATH=. python3 scripts/gpu_skinny_fusions.py --out $OUT/skinny_fusions.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels.skinny_gemm as sg  # noqa: E402
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.rmsnorm import rms_norm  # noqa: E402

H, I, QKV, LAYERS, EPS = 4096, 14336, 6144, 32, 1e-5


def _time_graph(body, replays: int = 9) -> float:
    """us per replay of a CUDA graph of body() (run once before capture to compile)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        body()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _per_layer(fn) -> float:
    return _time_graph(lambda: [fn(i) for i in range(LAYERS)]) / LAYERS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    w = {name: [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(LAYERS)]
         for name, n, k in (("qkv", QKV, H), ("o", H, H), ("gate_up", 2 * I, H), ("down", H, I))}
    g = torch.ones(H, device=dev, dtype=dt)
    x = torch.randn(1, H, device=dev, dtype=dt)
    r = torch.randn(1, H, device=dev, dtype=dt)
    gu = torch.randn(1, 2 * I, device=dev, dtype=dt)
    act = torch.randn(1, I, device=dev, dtype=dt)
    sq1 = (x.float() ** 2).sum(1, keepdim=True).repeat(1, 1)
    results: dict = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("BENCH_COMMIT", "?"),
                     "kernels": {}, "chain": {}}

    def sweep(label, fn_of_cfg, configs):
        times = {}
        for cfg in configs:
            try:
                times[str(cfg)] = _per_layer(lambda i, cfg=cfg: fn_of_cfg(i, cfg))
            except Exception as exc:            # a config that does not compile is reported
                times[str(cfg)] = f"failed: {type(exc).__name__}: {exc}"[:200]
        ok = {c: t for c, t in times.items() if isinstance(t, float)}
        if not ok:
            raise RuntimeError(f"{label}: no config ran: {times}")
        best = min(ok, key=ok.get)
        results["kernels"][label] = {"us": times, "best": best, "best_us": ok[best]}
        print(f"{label:34s} best {best:22s} {ok[best]:7.2f} us   " +
              " ".join(f"{c}:{t:.1f}" for c, t in ok.items()), flush=True)
        return next(c for c in configs if str(c) == best)

    def with_prefetch(on, fn):
        def run(i, cfg):
            sg._PREFETCH = on
            return fn(i, cfg)
        return run

    cfgs = {name: sg.candidate_configs(t[0].shape[0], t[0].shape[1]) for name, t in w.items()}
    extra = [sg.SkinnyConfig(64, 128, s, 4, 4) for s in (2, 4, 8)] + [sg.SkinnyConfig(32, 128, s, 4, 4) for s in (2, 4)]
    best = {}
    best["qkv"] = sweep("qkv plain", lambda i, c: sg.skinny_gemm(x, w["qkv"][i], config=c), cfgs["qkv"])
    for on in (True, False):
        best[f"qkv_norm_{on}"] = sweep(f"qkv norm prologue prefetch={on}", with_prefetch(on, lambda i, c: sg.skinny_gemm(
            x, w["qkv"][i], norm_weight=g, sum_sq=sq1, eps=EPS, config=c)), cfgs["qkv"] + extra)
    best["o"] = sweep("o_proj plain", lambda i, c: sg.skinny_gemm(x, w["o"][i], config=c), cfgs["o"])
    sq_o = {}

    def o_res(i, c):
        key = sg.sum_sq_parts(H, c)
        sq_o.setdefault(key, torch.zeros(1, key, device=dev))
        return sg.skinny_gemm(x, w["o"][i], residual=r, sum_sq_out=sq_o[key], out=r, config=c)
    best["o_res"] = sweep("o_proj residual epilogue", o_res, cfgs["o"] + extra)
    best["gate_up"] = sweep("gate_up plain", lambda i, c: sg.skinny_gemm(x, w["gate_up"][i], config=c), cfgs["gate_up"])
    for on in (True, False):
        best[f"gate_up_norm_{on}"] = sweep(f"gate_up norm prologue prefetch={on}", with_prefetch(on, lambda i, c: sg.skinny_gemm(
            x, w["gate_up"][i], norm_weight=g, sum_sq=sq1, eps=EPS, config=c)), cfgs["gate_up"])
    best["down"] = sweep("down plain", lambda i, c: sg.skinny_gemm(act, w["down"][i], config=c), cfgs["down"])
    for on in (True, False):
        best[f"down_silu_{on}"] = sweep(f"down silu prologue prefetch={on}", with_prefetch(on, lambda i, c: sg.skinny_gemm(
            gu, w["down"][i], silu_mul=True, config=c)), cfgs["down"] + extra)
    sq_d = {}

    def down_silu_res(i, c):
        key = sg.sum_sq_parts(H, c)
        sq_d.setdefault(key, torch.zeros(1, key, device=dev))
        return sg.skinny_gemm(gu, w["down"][i], silu_mul=True, residual=r, sum_sq_out=sq_d[key], out=r, config=c)
    sg._PREFETCH = True
    best["down_silu_res"] = sweep("down silu + residual epilogue", down_silu_res, cfgs["down"] + extra)
    results["kernels"]["rms_norm residual"] = {"best_us": _per_layer(lambda i: rms_norm(x, g, EPS, r))}
    results["kernels"]["silu_and_mul"] = {"best_us": _per_layer(lambda i: silu_and_mul(gu))}
    print("rms_norm + residual %.2f us, silu_and_mul %.2f us" % (
        results["kernels"]["rms_norm residual"]["best_us"], results["kernels"]["silu_and_mul"]["best_us"]), flush=True)

    # The chains, with PDL, best configs.
    pdl = True
    normed = torch.empty(1, H, device=dev, dtype=dt)
    res = torch.randn(1, H, device=dev, dtype=dt)

    def apart(i):
        rms_norm(x, g, EPS, res, out=normed, residual_out=res, pdl=pdl)
        sg.skinny_gemm(normed, w["qkv"][i], config=best["qkv"], pdl=pdl)
        o = sg.skinny_gemm(act[:, :H], w["o"][i], config=best["o"], pdl=pdl)
        rms_norm(o, g, EPS, res, out=normed, residual_out=res, pdl=pdl)
        gate_up = sg.skinny_gemm(normed, w["gate_up"][i], config=best["gate_up"], pdl=pdl)
        sg.skinny_gemm(silu_and_mul(gate_up, pdl=pdl), w["down"][i], config=best["down"], pdl=pdl)

    c_o, c_d = best["o_res"], best["down_silu_res"]
    sq_a = torch.ones(1, sg.sum_sq_parts(H, c_o), device=dev)
    sq_b = torch.ones(1, sg.sum_sq_parts(H, c_d), device=dev)
    res.fill_(0.01)

    def fused(i):
        sg.skinny_gemm(res, w["qkv"][i], norm_weight=g, sum_sq=sq_b, eps=EPS, config=best["qkv_norm_True"], pdl=pdl)
        sg.skinny_gemm(act[:, :H], w["o"][i], residual=res, sum_sq_out=sq_a, out=res, config=c_o, pdl=pdl)
        gate_up = sg.skinny_gemm(res, w["gate_up"][i], norm_weight=g, sum_sq=sq_a, eps=EPS,
                                 config=best["gate_up_norm_True"], pdl=pdl)
        sg.skinny_gemm(gate_up, w["down"][i], silu_mul=True, residual=res, sum_sq_out=sq_b, out=res, config=c_d, pdl=pdl)

    for name, fn in (("apart", apart), ("fused", fused), ("apart_again", apart)):
        results["chain"][name] = _per_layer(fn)
        print(f"chain {name}: {results['chain'][name]:.2f} us per layer", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
