"""Start-up choice, per decoder projection (and the lm_head) and row bucket, between cuBLAS and
the Triton skinny GEMM (kernels/skinny_gemm.py) for decode-sized inputs (up to 16 rows); fills
the projections' `skinny` / `skinny_silu` tables (engine/models/linear.py), and `skinny_chain`
with a Triton config whether or not it won (what a decode graph launched with PDL runs).

The chain's configs are timed in the form the chain runs them: unmerged where the model hands
the K slices' partials to the kernel after (`late_merge`: qkv_proj, o_proj, down_proj), merged
elsewhere; without PDL (timed in a chain of PDL launches of the same projection, other configs
won, and the decode step with them was slower: H200, 4.68 against 4.51 ms/token,
benchmarks/h200/decode_pdl.md). Among the candidates within CHAIN_MARGIN of the fastest,
`pick_chain` takes the fewest K slices: timed alone, slices look nearly free, but in the step
each one costs (the kernel after reads every slice's partial). H200, batch 1: that rule picked
the configs that made the whole step fastest in a search over the step itself, 4.29 -> 4.19 ms
a step (benchmarks/h200/chain_configs.md).

Why a start-up timing rather than a per-shape table: which kernel wins depends on the GPU, on
the cuBLAS version torch ships (its kernel choice for skinny shapes changes between releases),
on the shape and on the row count, and a table is right only for the machine and versions it was
measured on. The timing here measures exactly what decode will run: a CUDA graph of one
projection across every layer (each layer's own weights, so the weights stream from HBM as in a
decode step: 32 layers of qkv are 1.6 GB, far past the L2), replayed; time per call = graph time
/ layers, the median of a few replays. A Triton config is kept only where it beats cuBLAS by
MARGIN, so noise never picks a slower kernel. Cost: compiling the candidates (a second or two
each, once per machine with Triton's cache) and ~2 s of timing; a second engine in the same
process with the same shapes reuses the choice.
"""
from __future__ import annotations

import logging
import statistics
from typing import Callable

import torch
import torch.nn.functional as F

from engine.models.linear import ROW_BUCKETS, Linear
from kernels.activation import silu_and_mul
from kernels.skinny_gemm import SkinnyConfig, candidate_configs, chain_candidate_configs, num_k_slices, skinny_gemm

logger = logging.getLogger(__name__)

MARGIN = 0.03           # the Triton kernel must be this much faster than cuBLAS to be chosen
CHAIN_MARGIN = 0.02     # chain candidates this close to the fastest count as ties (pick_chain)
_CHOICES: dict[tuple, tuple[dict, dict, dict, list]] = {}


def pick(baseline_us: float, candidates_us: dict[SkinnyConfig, float],
         margin: float = MARGIN) -> SkinnyConfig | None:
    """The fastest candidate if it beats the baseline by `margin`, else None (the baseline)."""
    if not candidates_us:
        return None
    best = min(candidates_us, key=candidates_us.get)
    return best if candidates_us[best] < (1.0 - margin) * baseline_us else None


def pick_chain(candidates_us: dict[SkinnyConfig, float], k: int,
               margin: float = CHAIN_MARGIN) -> SkinnyConfig:
    """The chain's config for a weight of k columns: of the candidates within `margin` of the
    fastest, the one with the fewest K slices, then the fastest."""
    best = min(candidates_us.values())
    near = [c for c, t in candidates_us.items() if t <= (1.0 + margin) * best]
    return min(near, key=lambda c: (num_k_slices(k, c), candidates_us[c]))


def unmerged_in_chain(model) -> frozenset[str]:
    """The projections whose K slices a decode graph hands unmerged to the kernel after them
    (LlamaForCausalLM.late_merge; qkv_proj's to the fused rotary + KV write)."""
    if not getattr(model, "late_merge", False):
        return frozenset()
    return frozenset({"o_proj", "down_proj"} | ({"qkv_proj"} if model.fuse_rope_kv_write else set()))


def replay_ms(body: Callable[[], object], device: torch.device, replays: int = 7) -> float:
    """Median milliseconds of one replay of a CUDA graph of body() (run once before the capture,
    on the capture's stream: compiles, split-K counters and the like happen outside it). Also
    the GPU scripts' timer."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        body()
    torch.cuda.synchronize(device)
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
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def _time_us(fn: Callable[[Linear], torch.Tensor], linears: list[Linear], device: torch.device,
             replays: int = 7) -> float:
    """Microseconds per call of fn over the layers' projections, as a CUDA graph replays them."""
    return replay_ms(lambda: [fn(lin) for lin in linears], device, replays) * 1e3 / len(linears)


def _projections(model) -> dict[str, list[Linear]]:
    """The projections that may run the skinny GEMM: not FP8 ones (engine/models/fp8_linear.py)."""
    layers = model.layers
    out = {"qkv_proj": [l.self_attn.qkv_proj for l in layers], "o_proj": [l.self_attn.o_proj for l in layers],
           "gate_up_proj": [l.mlp.gate_up_proj for l in layers], "down_proj": [l.mlp.down_proj for l in layers]}
    if isinstance(model.lm_head, Linear):       # tied embeddings: F.linear over embed_tokens
        out["lm_head"] = [model.lm_head]
    return {name: linears for name, linears in out.items() if isinstance(linears[0], Linear)}


@torch.inference_mode()
def tune_skinny_gemms(model, device: torch.device) -> list[dict]:
    """Times cuBLAS and every candidate config for each projection and row bucket, sets the
    projections' tables to the winners and returns one report row per (projection, rows)."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    unmerged = unmerged_in_chain(model)
    report: list[dict] = []
    for name, linears in _projections(model).items():
        weight, bias = linears[0].weight, linears[0].bias
        n, k = weight.shape
        key = (torch.cuda.get_device_name(device), torch.__version__, name, n, k, weight.dtype,
               bias is not None, len(linears), ROW_BUCKETS, name in unmerged)
        if key not in _CHOICES:
            _CHOICES[key] = _tune(name, linears, n, k, weight.dtype, device, num_sms, name in unmerged)
        skinny, skinny_silu, chain, rows = _CHOICES[key]
        for lin in linears:
            lin.skinny, lin.skinny_silu, lin.skinny_chain = dict(skinny), dict(skinny_silu), dict(chain)
        report += rows
    for r in report:
        logger.info("GEMM %s %s N=%d K=%d rows=%d: cuBLAS %.1f us, best Triton %s %.1f us -> %s",
                    r["proj"], "(silu_mul)" if r["silu_mul"] else "", r["n"], r["k"], r["rows"],
                    r["baseline_us"], r["best"], r["best_us"], r["chosen"])
    return report


def _tune(name: str, linears: list[Linear], n: int, k: int, dtype: torch.dtype, device: torch.device,
          num_sms: int, unmerged: bool) -> tuple[dict, dict, dict, list]:
    """unmerged: the chain runs this projection with merge=False (unmerged_in_chain)."""
    configs = candidate_configs(n, k, num_sms)
    chain_configs = chain_candidate_configs(n, k, num_sms)
    gen = torch.Generator(device=device).manual_seed(0)
    skinny: dict[int, SkinnyConfig] = {}
    skinny_silu: dict[int, SkinnyConfig] = {}
    chain: dict[int, SkinnyConfig] = {}
    rows_out = []
    for rows in ROW_BUCKETS:
        x = torch.randn(rows, k, device=device, dtype=dtype, generator=gen)
        baseline = _time_us(lambda lin: F.linear(x, lin.weight, lin.bias), linears, device)
        times = {c: _time_us(lambda lin, c=c: skinny_gemm(x, lin.weight, lin.bias, config=c), linears, device)
                 for c in configs}
        choice = pick(baseline, times)
        if choice is not None:
            skinny[rows] = choice
        if unmerged:        # the reader adds the partials and the bias
            chain_times = {c: _time_us(lambda lin, c=c: skinny_gemm(x, lin.weight, config=c, merge=False),
                                       linears, device) for c in chain_configs}
        else:
            chain_times = {c: times[c] if c in times else
                           _time_us(lambda lin, c=c: skinny_gemm(x, lin.weight, lin.bias, config=c), linears, device)
                           for c in chain_configs}
        chain[rows] = pick_chain(chain_times, k)
        row = _row(name, n, k, rows, False, "cuBLAS", baseline, times, choice)
        row.update(chain=str(chain[rows]), chain_form="unmerged" if unmerged else "merged",
                   chain_us={str(c): t for c, t in chain_times.items()})
        rows_out.append(row)
    if name == "down_proj":       # SiLU-and-mul in the prologue vs its own kernel before the GEMM
        for lin in linears:
            lin.skinny = dict(skinny)
        for rows in ROW_BUCKETS:
            g = torch.randn(rows, 2 * k, device=device, dtype=dtype, generator=gen)
            baseline = _time_us(lambda lin: lin(silu_and_mul(g)), linears, device)
            times = {c: _time_us(lambda lin, c=c: skinny_gemm(g, lin.weight, lin.bias, silu_mul=True, config=c),
                                 linears, device) for c in configs}
            choice = pick(baseline, times)
            if choice is not None:
                skinny_silu[rows] = choice
            rows_out.append(_row(name, n, k, rows, True, "silu_and_mul + chosen GEMM", baseline, times, choice))
    return skinny, skinny_silu, chain, rows_out


def _row(name, n, k, rows, silu_mul, baseline_name, baseline, times, choice) -> dict:
    best = min(times, key=times.get)
    return {"proj": name, "n": n, "k": k, "rows": rows, "silu_mul": silu_mul, "baseline": baseline_name,
            "baseline_us": baseline, "triton_us": {str(c): t for c, t in times.items()},
            "best": str(best), "best_us": times[best], "chosen": "triton " + str(choice) if choice else "baseline"}
