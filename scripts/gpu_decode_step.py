"""One batch-1 decode step of the Llama-3.1-8B preset (bf16, dummy weights) with the decode
kernels of issue 13 on and off, in one engine (the weights are built once).

Variants, each with the decode CUDA graphs captured afresh:
  on          what the engine runs by default: fused RoPE + KV write, skinny GEMMs where the
              start-up timing chose them (engine/gemm_tuning.py; its table is reported),
              attention's splits merged in its kernel (fuse_kv_split_merge: 8 splits at batch 1
              up to 511 keys), PDL (decode_pdl: every projection the skinny GEMM)
  silu_in_down
              PDL, late merge, and down_proj with SiLU-and-mul in its prologue (its chain config)
              in place of the SiLU kernel, whatever the start-up timing chose
  late_merge, early_merge
              PDL, and qkv_proj's, o_proj's and down_proj's split-K partials merged by the
              kernel after them or by the GEMM's last program (decode_late_merge true / false)
  no_pdl      on without PDL (decode_pdl=False: cuBLAS where it won the timing)
  merge_apart on, but attention's splits by choose_num_kv_splits and merged by the separate
              kernel (fuse_kv_split_merge=False: one split at batch 1 up to 511 keys)
  off         rotary_embedding + write_kv, cuBLAS for every projection, the separate merge (the
              engine before issue 13: EngineConfig(fuse_rope_kv_write=False, skinny_gemm="off",
              fuse_kv_split_merge=False))
  rope_kv     fused RoPE + KV write only
Ablations (timing only: the logits are garbage), "on" with some kernels not launched, to see what
each group of kernels costs in the PDL chain, i.e. what fusing it away could save at most:
  skip_attention       no attention kernel (o_proj reads an unwritten buffer)
  skip_rope_attention  neither rotary + KV write nor attention
  skip_norms           no RMSNorm kernel (the projections read unwritten buffers)
  skip_small           none of those nor SiLU-and-mul: the chain of weight GEMMs alone
Per variant: the GPU time of one replay of the batch-1 graph at --context tokens (median of
replays back to back), ms/token of a greedy generation (128-token prompt, as
scripts/bench_latency.py), the step's kernels (torch.profiler over 3 replays), and the logits'
difference from "off" on the same inputs.

    python3 scripts/gpu_decode_step.py --out $OUT/decode_step.json
(scripts/gpu_check_decode_kernels.py runs this as its last section.)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.models.linear import Linear  # noqa: E402


def _linears(model) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def _set_variant(runner, fuse_rope: bool, tables: dict | None, kv_merge_in_kernel: bool,
                 pdl: bool = False, late_merge: bool = False) -> None:
    """Switch the model's kernels and capture its decode graphs again."""
    from engine.cuda_graphs import DecodeGraphs
    runner.model.fuse_rope_kv_write = fuse_rope
    runner.model.late_merge = late_merge
    for lin in _linears(runner.model):
        lin.skinny, lin.skinny_silu, lin.skinny_chain = (
            dict(t) for t in (tables or {}).get(id(lin), ({}, {}, {})))
    old = runner.decode_graphs
    runner.decode_graphs = None
    graphs = DecodeGraphs(runner.model, runner.kv_caches, old.max_batch, old.block_table.shape[1],
                          old.max_seqlen_k, runner.device, use_graphs=True, cascade_splits=old.cascade_splits,
                          kv_merge_in_kernel=kv_merge_in_kernel, pdl=pdl)
    del old
    gc.collect()
    torch.cuda.empty_cache()
    graphs.capture()
    runner.decode_graphs = graphs


ABLATIONS = {"skip_attention": ("attention",), "skip_rope_attention": ("attention", "rope"),
             "skip_norms": ("norms",), "skip_small": ("attention", "rope", "norms", "silu")}


def _ablate(runner, skip: tuple[str, ...]):
    """Patches the model so the kernels of `skip` are not launched (outputs left unwritten) and
    returns a function undoing it."""
    import dataclasses

    import engine.models.linear as linear_module
    import engine.models.llama as llama_module
    undo = []
    attns = [layer.self_attn.attn for layer in runner.model.layers]
    backends = [a.backend for a in attns]
    changes = {}
    if "attention" in skip:
        changes["paged_attention"] = lambda q, *a, out=None, **k: torch.empty_like(q) if out is None else out
    if "rope" in skip:
        changes["rotary_write_kv"] = lambda *a, **k: None
    if changes:
        for a in attns:
            a.backend = dataclasses.replace(a.backend, **changes)
        undo.append(lambda: [setattr(a, "backend", b) for a, b in zip(attns, backends)])
    if "norms" in skip:
        real = llama_module.rms_norm

        def no_norm(x, weight, eps, residual=None, *, x_parts=None, **kw):
            ref = residual if residual is not None else x
            out = torch.empty_like(ref)
            return out if residual is None else (out, ref)
        llama_module.rms_norm = no_norm
        undo.append(lambda: setattr(llama_module, "rms_norm", real))
    if "silu" in skip:
        real_silu = linear_module.silu_and_mul
        linear_module.silu_and_mul = lambda g, out=None, pdl=False: torch.empty(
            g.shape[0], g.shape[1] // 2, dtype=g.dtype, device=g.device)
        undo.append(lambda: setattr(linear_module, "silu_and_mul", real_silu))
    return lambda: [u() for u in reversed(undo)]


def _step_graph(runner, context: int):
    """Fills the batch-1 graph's inputs for one sequence of `context` tokens over the last blocks
    of the pool, whose K/V are set to the same random values every time (generations may have
    used them), and returns (graph, logits of one replay)."""
    g = runner.decode_graphs
    bs = runner.block_size
    num = -(-context // bs)
    blocks = np.arange(runner.num_blocks - num, runner.num_blocks, dtype=np.int32)[None]
    gen = torch.Generator(device=runner.device).manual_seed(0)
    ids = torch.as_tensor(blocks[0], device=runner.device).long()
    for k_cache, v_cache in runner.kv_caches:
        for cache in (k_cache, v_cache):
            cache[ids] = torch.randn(cache[ids].shape, generator=gen, device=runner.device).to(cache.dtype)
    pos = context - 1
    slot = int(blocks[0, pos // bs]) * bs + pos % bs
    logits = g.run(np.array([11]), np.array([pos]), np.array([slot]), blocks,
                   np.array([context], dtype=np.int32)).clone()
    graph, _ = g.graphs[1, g.kv_splits(1, context)]
    return graph, logits, g.kv_splits(1, context)


def _replay_ms(graph, replays: int = 30) -> float:
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def _kernel_table(graph, replays: int = 3) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if total > 0 and e.count:
            rows.append({"kernel": e.key[:100], "per_step": e.count / replays, "us_each": total / e.count,
                         "us_per_step": total / replays})
    return sorted(rows, key=lambda r: -r["us_per_step"])


def _ms_per_token(llm, tag: str, prompt: list[int], output_len: int, iters: int = 2) -> float:
    from engine import SamplingParams
    core = llm.core
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    times = []
    for it in range(iters):
        core.add_request(core.make_request(f"{tag}{it}", prompt, params))
        first = True
        while core.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = core.step()
            if outs and not first:
                times.append(time.perf_counter() - t0)
            elif outs:
                first = False
    return 1e3 * statistics.median(times)


def check_engine(args, out: dict) -> None:
    from engine import LLM
    from scripts.bench_common import PRESETS, preset_dir
    llm = LLM(preset_dir("llama-3.1-8b"), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              max_num_seqs=1, max_model_len=1024, max_num_batched_tokens=256, num_kv_blocks=4096)
    runner = llm.core.runner
    report = {"gemm_choice": runner.gemm_report, "context": args.context, "variants": {}}
    out["engine"] = report
    print("start-up GEMM choice (us per call, graph of 32 layers):")
    for r in runner.gemm_report:
        print(f"  {r['proj']:>12}{' +silu' if r['silu_mul'] else '':6} M={r['rows']:2d}: {r['baseline']} "
              f"{r['baseline_us']:6.2f} | Triton {r['best']} {r['best_us']:6.2f} -> {r['chosen']}")
    tables = {id(lin): (dict(lin.skinny), dict(lin.skinny_silu), dict(lin.skinny_chain))
              for lin in _linears(runner.model)}
    vocab = PRESETS["llama-3.1-8b"]["vocab_size"]
    prompt = [(i * 7919) % vocab for i in range(128)]
    logits_off = None
    assert runner.decode_graphs.kv_merge_in_kernel, "the engine's default merges attention's splits in its kernel"
    pdl_on = runner.decode_graphs.pdl
    merge_on = runner.model.late_merge
    # down_proj with SiLU-and-mul in its prologue wherever the chain runs it (no SiLU kernel)
    downs = {id(layer.mlp.down_proj) for layer in runner.model.layers}
    silu_tables = {key: (t[0], t[2], t[2]) if key in downs else t for key, t in tables.items()}
    variants = (("on", True, tables, True, pdl_on, merge_on),
                ("silu_in_down", True, silu_tables, True, True, True),
                ("late_merge", True, tables, True, True, True), ("early_merge", True, tables, True, True, False),
                ("no_pdl", True, tables, True, False, False),
                ("merge_apart", True, tables, False, False, False), ("off", False, None, False, False, False),
                ("rope_kv", True, None, False, False, False))
    logits_on = None
    for name, fuse_rope, tab, kv_merge, pdl, late_merge in variants:
        if name not in getattr(args, "variants", [v[0] for v in variants]):
            continue
        if name != "on":
            _set_variant(runner, fuse_rope, tab, kv_merge, pdl, late_merge)
        graph, logits, kv_splits = _step_graph(runner, args.context)
        row = {"step_ms": _replay_ms(graph), "ms_per_token": _ms_per_token(llm, name, prompt, args.output_len),
               "kv_splits": kv_splits, "kv_merge_in_kernel": kv_merge, "kernels": _kernel_table(graph),
               "pdl": pdl, "late_merge": late_merge}
        if name != "on" and logits_on is not None:
            diff = (logits_on - logits).abs().max().item()
            row["logits_vs_on"] = {"max_abs_diff": diff, "max_abs": logits_on.abs().max().item(),
                                   "same_argmax": bool(logits_on.argmax() == logits.argmax())}
        row["kernel_us_per_step"] = sum(r["us_per_step"] for r in row["kernels"])
        row["kernel_launches_per_step"] = sum(r["per_step"] for r in row["kernels"])
        if name == "on":
            logits_on = logits
        if name == "merge_apart":
            diff = (logits_on - logits).abs().max().item()
            report["logits_on_vs_merge_apart"] = {"max_abs_diff": diff, "max_abs": logits.abs().max().item(),
                                                  "same_argmax": bool(logits_on.argmax() == logits.argmax())}
        if name == "off":
            logits_off = logits
            diff = (logits_on - logits_off).abs().max().item()
            report["logits_on_vs_off"] = {"max_abs_diff": diff, "max_abs": logits_off.abs().max().item(),
                                          "same_argmax": bool(logits_on.argmax() == logits_off.argmax())}
        report["variants"][name] = row
        print(f"\n[{name}] ({kv_splits} KV splits, merged {'in the kernel' if kv_merge else 'apart'}) "
              f"step (graph replay) {row['step_ms']:.3f} ms, generation {row['ms_per_token']:.3f} "
              f"ms/token; kernels {row['kernel_us_per_step'] / 1e3:.3f} ms in "
              f"{row['kernel_launches_per_step']:.0f} launches per step"
              + (f"; logits vs on: {row['logits_vs_on']}" if "logits_vs_on" in row else ""))
        for r in row["kernels"][:getattr(args, "top_kernels", 16)]:
            print(f"  {r['us_per_step']:8.1f} us/step {r['per_step']:5.0f} x {r['us_each']:7.2f} us  {r['kernel']}")
    for name, skip in ABLATIONS.items():
        if name not in getattr(args, "variants", []):
            continue
        restore = _ablate(runner, skip)
        _set_variant(runner, True, tables, True, pdl_on, merge_on)
        graph, _, kv_splits = _step_graph(runner, args.context)
        row = {"step_ms": _replay_ms(graph), "skipped": list(skip), "kernels": _kernel_table(graph)}
        row["kernel_launches_per_step"] = sum(r["per_step"] for r in row["kernels"])
        restore()
        report["variants"][name] = row
        print(f"\n[{name}] step (graph replay) {row['step_ms']:.3f} ms in {row['kernel_launches_per_step']:.0f} "
              f"launches per step")
    if any(name in report["variants"] for name in ABLATIONS):     # the graphs as the engine runs them
        _set_variant(runner, True, tables, True, pdl_on, merge_on)
    if "logits_on_vs_off" in report:
        print(f"\nlogits on vs off: {report['logits_on_vs_off']}")
    if "logits_on_vs_merge_apart" in report:
        v = report["variants"]
        print(f"logits on vs merge_apart: {report['logits_on_vs_merge_apart']}; step on {v['on']['step_ms']:.3f} ms "
              f"vs merge_apart {v['merge_apart']['step_ms']:.3f} ms "
              f"({1e3 * (v['merge_apart']['step_ms'] - v['on']['step_ms']):+.1f} us saved)")
    llm.core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--top-kernels", type=int, default=16)
    ap.add_argument("--variants", nargs="+", default=["on", "no_pdl", "merge_apart", "off", "rope_kv"],
                    help="of: on silu_in_down late_merge early_merge no_pdl merge_apart off rope_kv "
                         + " ".join(ABLATIONS))
    args = ap.parse_args()
    out: dict = {"gpu": torch.cuda.get_device_name()}
    check_engine(args, out)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
