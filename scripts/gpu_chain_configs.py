"""Which skinny GEMM configs make the batch-1 decode step fastest (issue 13's single stream).

A decode graph launched with PDL runs every projection as the Triton skinny GEMM, at the config
the start-up timing (engine/gemm_tuning.py) put in `skinny_chain`. Until d78d2cc that was the
fastest of a few candidates, each timed with its K slices merged in the kernel (the last
program's store, atomic and reload), while the chain runs qkv_proj, o_proj and down_proj
unmerged (late merge: the kernel after them adds the slices' partials as it reads them). This
script is how the rule that replaced it was found and is checked.

It
  1. times a wider set of configs for each projection three ways: alone, the way the chain runs
     it (unmerged for qkv_proj, o_proj, down_proj; merged for gate_up_proj), as the start-up
     timing does (a CUDA graph of the projection over every layer's weights, one row); followed
     by the kernel that reads its output in the step (`pair`); and that pair with PDL
     (`pair_pdl`);
  2. puts the best few of each projection into the real batch-1 step graph, one projection at a
     time, keeping whichever made the step fastest (graph replay at --context keys);
  3. replays the start-up choice, the best found and each timing's own top picks alternately,
     runs a greedy generation with each (ms/token as bench_latency.py counts it), and compares
     the logits of the start-up choice and the best.
With `--phases attention` (after or instead of the above) it forces the batch-1 graph's decode
attention split count and tile, every pair, and replays the default against the fastest pair.
Results: benchmarks/h200/chain_configs.md.

    PYTHONPATH=. python3 scripts/gpu_chain_configs.py --out $OUT/chain_configs.json [--phases gemm attention]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.skinny_gemm import SkinnyConfig, _split  # noqa: E402

PROJECTIONS = ("down_proj", "qkv_proj", "o_proj", "gate_up_proj")    # the step's order of trial
UNMERGED = ("qkv_proj", "o_proj", "down_proj")                       # late merge: the chain's form
_TILES = ((16, 256, 2), (16, 512, 4), (32, 128, 4), (32, 256, 4), (32, 512, 4), (64, 128, 4), (64, 256, 4))
_SMEM_BYTES = 160 * 1024     # weight stages a program may hold (bf16)
METHODS = ("alone", "pair", "pair_pdl")     # ways of timing a config outside the step


def wide_configs(n: int, k: int, num_sms: int) -> list[SkinnyConfig]:
    """Tiles of 16-64 weight rows, 128-512 columns a step, 1-6 programs an SM, 3 or 4 stages."""
    out: list[SkinnyConfig] = []
    for block_n, block_k, warps in _TILES:
        for per_sm in (1, 2, 3, 4, 6):
            for stages in (3, 4):
                if block_n * block_k * 2 * stages > _SMEM_BYTES:
                    continue
                cfg = SkinnyConfig(block_n, block_k, _split(n, k, block_n, block_k, num_sms, per_sm), warps, stages)
                if cfg not in out:
                    out.append(cfg)
    return out


def ranked(times: dict[str, float], keep: int, first: str) -> list[str]:
    """`first`, then the `keep` fastest others, by time."""
    return [first] + [c for c in sorted(times, key=times.get) if c != first][:keep]


def _tables(base: dict, linears_by_proj: dict, chosen: dict) -> dict:
    """The start-up tables with the chain's one-row config of each projection in `chosen`."""
    tables = {key: (dict(a), dict(b), dict(c)) for key, (a, b, c) in base.items()}
    for name, cfg in chosen.items():
        for lin in linears_by_proj[name]:
            tables[id(lin)][2][1] = cfg
    return tables


# (rows, keys a step, warps, stages); the first: the engine's at batch 1
ATTENTION_TILES = ((16, 64, 8, 2), (16, 64, 4, 2), (16, 32, 4, 2), (16, 64, 2, 2), (16, 64, 4, 3),
                   (16, 128, 4, 2), (16, 32, 2, 3))


def attention_search(llm, runner, args, out: dict, save) -> None:
    """The batch-1 step with the decode attention's split count (graphs of contexts up to 511
    keys) and tile forced, every pair; then the default and the fastest pair alternately."""
    import engine.cuda_graphs as cg
    import kernels.paged_attention as pa
    from scripts.gpu_decode_step import _replay_ms, _set_variant, _step_graph

    real_splits, real_pick = cg.decode_kv_splits, pa._pick_config
    tables = {id(lin): (dict(lin.skinny), dict(lin.skinny_silu), dict(lin.skinny_chain))
              for lin in runner.model.modules() if hasattr(lin, "skinny_chain")}

    def force(splits: int | None, tile: tuple | None) -> None:
        def kv_splits(size, num_kv_heads, context, merge_in_kernel):
            if splits is not None and size == 1 and context <= 511:
                return splits
            return real_splits(size, num_kv_heads, context, merge_in_kernel)

        def pick(max_seqlen_q, head_dim, dtype, fused_splits=False, fp8_cache=False, num_seqs=None):
            if tile is not None and max_seqlen_q == 1 and fused_splits:
                return pa._TileConfig(*tile)
            return real_pick(max_seqlen_q, head_dim, dtype, fused_splits, fp8_cache, num_seqs)
        cg.decode_kv_splits, pa._pick_config = kv_splits, pick
        _set_variant(runner, True, tables, True, True, True)

    rows, logits = [], {}
    default_splits = real_splits(1, runner.model.config.num_key_value_heads, 511, True)
    for splits in args.attention_splits:
        for tile in ATTENTION_TILES:
            force(splits, tile)
            graph, lg, used = _step_graph(runner, args.context)
            rows.append({"splits": splits, "used_splits": used, "tile": list(tile), "step_ms": _replay_ms(graph)})
            logits[(splits, tile)] = lg
            print(f"  attention {splits} splits, tile {tile}: {rows[-1]['step_ms']:.4f} ms", flush=True)
    best = min(rows, key=lambda r: r["step_ms"])
    final = []
    for rnd in range(3):
        for tag, splits, tile in (("default", None, None), ("best", best["splits"], tuple(best["tile"]))):
            force(splits, tile)
            graph, lg, used = _step_graph(runner, args.context)
            logits[tag] = lg
            final.append({"round": rnd, "variant": tag, "splits": used, "step_ms": _replay_ms(graph)})
            print(f"  round {rnd} {tag}: {final[-1]}", flush=True)
    cg.decode_kv_splits, pa._pick_config = real_splits, real_pick
    out["attention"] = {"default_splits": default_splits, "default_tile": list(ATTENTION_TILES[0]),
                        "trials": rows, "best": best, "final": final,
                        "logits_best_vs_default_max_abs_diff":
                            (logits["best"] - logits["default"]).abs().max().item()}
    save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--keep", type=int, default=3, help="configs per projection tried in the step")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--start", nargs="*", default=[], help="proj=config to start the step's search from")
    ap.add_argument("--phases", nargs="+", default=["gemm"], choices=["gemm", "attention"])
    ap.add_argument("--attention-splits", nargs="+", type=int, default=[3, 4, 5, 8])
    args = ap.parse_args()
    t_start = time.monotonic()

    from engine import LLM
    from engine.gemm_tuning import _projections, _time_us
    from kernels.activation import silu_and_mul
    from kernels.rmsnorm import rms_norm
    from kernels.rotary_write_kv import rotary_write_kv
    from kernels.skinny_gemm import skinny_gemm
    from scripts.bench_common import PRESETS, preset_dir
    from scripts.gpu_decode_step import _linears, _ms_per_token, _replay_ms, _set_variant, _step_graph

    out: dict = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("BENCH_COMMIT", "unknown"),
                 "context": args.context, "command": " ".join(sys.argv)}

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)

    llm = LLM(preset_dir("llama-3.1-8b"), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              max_num_seqs=1, max_model_len=1024, max_num_batched_tokens=256, num_kv_blocks=4096)
    runner = llm.core.runner
    device = runner.device
    assert runner.decode_graphs.pdl and runner.model.late_merge, "the step this script tunes: PDL, late merge"
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    by_proj = _projections(runner.model)
    base = {id(lin): (dict(lin.skinny), dict(lin.skinny_silu), dict(lin.skinny_chain))
            for lin in _linears(runner.model)}
    start_up = {name: by_proj[name][0].skinny_chain[1] for name in PROJECTIONS}
    out["start_up_chain"] = {name: str(c) for name, c in start_up.items()}
    print(f"engine up in {time.monotonic() - t_start:.0f} s; start-up chain configs: {out['start_up_chain']}",
          flush=True)

    if "gemm" in args.phases:
        cfg_model = runner.model.config
        hq, hkv, hd = cfg_model.num_attention_heads, cfg_model.num_key_value_heads, cfg_model.head_dim
        hidden = cfg_model.hidden_size
        x = torch.randn(1, 14336, device=device, dtype=torch.bfloat16)
        residual = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
        norm_w = torch.ones(hidden, device=device, dtype=torch.bfloat16)
        k_cache = torch.zeros(4, 16, hkv, hd, device=device, dtype=torch.bfloat16)
        v_cache = torch.zeros_like(k_cache)
        slot = torch.tensor([17], device=device)
        pos = torch.tensor([300], device=device)
        cos = torch.rand(1024, hd // 2, device=device)
        sin = torch.rand(1024, hd // 2, device=device)
        qkv_buf = torch.empty(1, (hq + 2 * hkv) * hd, device=device, dtype=torch.bfloat16)
        q3, k3, v3 = (t.view(1, -1, hd) for t in qkv_buf.split([hq * hd, hkv * hd, hkv * hd], dim=-1))

        def pair_call(name: str, c: SkinnyConfig, method: str):
            """fn(lin) for _time_us: the projection as the chain runs it, alone or followed by the
            kernel that reads its output in the step, without or with PDL."""
            k = by_proj[name][0].weight.shape[1]
            xin = x[:, :k]
            if method == "alone":
                return lambda lin: skinny_gemm(xin, lin.weight, config=c, merge=name not in UNMERGED)
            pdl = method == "pair_pdl"
            if name == "gate_up_proj":
                return lambda lin: silu_and_mul(skinny_gemm(xin, lin.weight, config=c, pdl=pdl), pdl=pdl)
            if name == "qkv_proj":
                return lambda lin: rotary_write_kv(
                    q3, k3, v3, k_cache, v_cache, slot, pos, cos, sin, pdl=pdl,
                    qkv_parts=skinny_gemm(xin, lin.weight, config=c, merge=False, pdl=pdl))
            return lambda lin: rms_norm(None, norm_w, 1e-5, residual, pdl=pdl,
                                        x_parts=skinny_gemm(xin, lin.weight, config=c, merge=False, pdl=pdl))

        # 1. alone, as the chain runs each projection; and in pairs with the kernel that reads its
        #    output (the partials' reader for the unmerged ones), without and with PDL
        alone: dict[str, dict[str, dict[str, float]]] = {m: {} for m in METHODS}
        configs: dict[str, dict[str, SkinnyConfig]] = {}
        with torch.inference_mode():
            for name in PROJECTIONS:
                linears = by_proj[name]
                n, k = linears[0].weight.shape
                cands = wide_configs(n, k, num_sms)
                if start_up[name] not in cands:
                    cands.append(start_up[name])
                cfgs = {}
                for c in cands:
                    try:
                        row = {m: _time_us(pair_call(name, c, m), linears, device) for m in METHODS}
                    except Exception as e:      # out of shared memory or registers: not a candidate
                        print(f"  {name} {c}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    cfgs[str(c)] = c
                    for m in METHODS:
                        alone[m].setdefault(name, {})[str(c)] = row[m]
                configs[name] = cfgs
                for m in METHODS:
                    times = alone[m][name]
                    best = min(times, key=times.get)
                    print(f"{name} N={n} K={k} {m}: start-up {start_up[name]} {times[str(start_up[name])]:.2f} us, "
                          f"best {best} {times[best]:.2f} us ({len(times)} configs, "
                          f"{time.monotonic() - t_start:.0f} s)",
                          flush=True)
        out["alone_us"] = alone
        picks = {m: {name: configs[name][min(alone[m][name], key=alone[m][name].get)] for name in PROJECTIONS}
                 for m in METHODS}
        out["picks"] = {m: {p: str(c) for p, c in v.items()} for m, v in picks.items()}
        save()

        # 2. the step, one projection at a time
        chosen = dict(start_up)
        for item in args.start:
            name, cfg_name = item.split("=")
            chosen[name] = configs[name][cfg_name]
        trials = []
        for name in PROJECTIONS:
            tries = [str(chosen[name])]
            for m in METHODS:
                tries += [c for c in ranked(alone[m][name], args.keep, str(chosen[name])) if c not in tries]
            for cfg_name in tries:
                if time.monotonic() - t_start > args.budget_s:
                    print(f"budget spent: {name} {cfg_name} not tried", flush=True)
                    break
                trial = dict(chosen, **{name: configs[name][cfg_name]})
                _set_variant(runner, True, _tables(base, by_proj, trial), True, True, True)
                graph, _, _ = _step_graph(runner, args.context)
                ms = _replay_ms(graph)
                trials.append({"proj": name, "config": cfg_name, "step_ms": ms,
                               "others": {p: str(c) for p, c in chosen.items() if p != name}})
                print(f"  step with {name} {cfg_name}: {ms:.4f} ms", flush=True)
            tried = [t for t in trials if t["proj"] == name]
            if tried:
                best = min(tried, key=lambda t: t["step_ms"])
                chosen[name] = configs[name][best["config"]]
            out["trials"], out["chosen"] = trials, {p: str(c) for p, c in chosen.items()}
            save()

        # 3. start-up choice against the best found, alternating
        final = []
        logits = {}
        variants = [("start_up", start_up), ("best", chosen)] + [(f"pick_{m}", picks[m]) for m in METHODS]
        for rnd in range(3):
            for tag, pick in variants:
                _set_variant(runner, True, _tables(base, by_proj, pick), True, True, True)
                graph, lg, _ = _step_graph(runner, args.context)
                logits[tag] = lg
                row = {"round": rnd, "variant": tag, "step_ms": _replay_ms(graph)}
                if rnd == 0:
                    vocab = PRESETS["llama-3.1-8b"]["vocab_size"]
                    prompt = [(i * 7919) % vocab for i in range(128)]
                    row["ms_per_token"] = _ms_per_token(llm, f"{tag}{rnd}", prompt, args.output_len)
                final.append(row)
                print(f"  round {rnd} {tag}: {row}", flush=True)
        diff = (logits["start_up"] - logits["best"]).abs().max().item()
        out["final"] = final
        out["logits_best_vs_start_up"] = {"max_abs_diff": diff, "max_abs": logits["start_up"].abs().max().item(),
                                          "same_argmax": bool(logits["start_up"].argmax() == logits["best"].argmax())}
        print(f"logits best vs start-up: {out['logits_best_vs_start_up']}", flush=True)
        save()
    if "attention" in args.phases:
        attention_search(llm, runner, args, out, save)
    llm.core.shutdown()


if __name__ == "__main__":
    main()
