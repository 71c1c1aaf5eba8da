"""Cascade attention on a GPU at Llama-3.1-8B shapes (Hq 32, Hkv 8, D 128, block 16, bf16).

1. Correctness in bf16 against `cascade_attention_ref` (fp32 math and output): the relative error
   ||out - ref|| / ||ref|| beside torch's own bf16 error on the same attention (per-sequence SDPA
   in bf16 over the gathered [prefix + own] keys) and the plain paged kernel's; a case passes when
   its error is at most 2x torch's, no element is off by more than atol 1.5e-2 + rtol 1e-2 and none
   is NaN (out is NaN-poisoned first). Cases: 256 decode rows in groups of 16 / 4 / 64 (prefix 2000
   / 496 / 8000 tokens, 200 own), prefill chunks and decode rows mixed in groups with lone
   requests, metadata padded to capacities, and a CUDA-graph replay after lengths change and a
   group dissolves (captured after a call under torch.cuda.set_sync_debug_mode("error")).
2. Timing: triton.testing.do_bench (median; it flushes L2 before each run) of each kernel replayed
   from a CUDA graph, so host launch costs are not counted: cascade vs the plain paged-attention
   kernel on the same batch (same block tables: the members' prefix blocks are the same physical
   blocks, as prefix caching leaves them). 256 decode rows with 200 own tokens each, groups of
   2/4/16/64 members x prefixes of 128/496/2000/8000 tokens (whole blocks: 496, not 500).
   Reported: the KV bytes each kernel's algorithm reads (plain: every member's whole context;
   cascade: each prefix once per prefix tile, plus the own tokens; L2 hits count as reads) over
   its time in GB/s, the prefix and own passes' times alone, the speedup, and the cost rule's
   verdict (CascadeCostRule's default thresholds) beside the measured winner. The fixed cost cascade pays
   beyond its bytes, in bytes at the plain kernel's rate, is printed as data for min_saved_bytes.
3. --sweep: each pass alone on three of those batches: the prefix pass over tile configs and
   split counts, the decode own pass over tile configs.

    python scripts/gpu_check_cascade.py --out DIR      # writes DIR/gpu_check_cascade.json + .txt
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels.cascade_attention as ca  # noqa: E402
from kernels.cascade_attention import (  # noqa: E402
    CascadeCostRule, PrefixGroup, cascade_attention, cascade_attention_ref)
from kernels.paged_attention import paged_attention  # noqa: E402
from scripts.bench_common import capture_graph  # noqa: E402

HQ, HKV, D, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"
ATOL, RTOL = 1.5e-2, 1e-2
MAX_ERR_VS_TORCH = 2.0
HBM_BYTES_PER_S = 4.8e12
GROUP_SIZES = (2, 4, 16, 64)
PREFIX_LENS = (128, 496, 2000, 8000)
NUM_ROWS, OWN_LEN = 256, 200


def kv_bytes_per_token() -> int:
    return 2 * HKV * D * DTYPE.itemsize


class Batch:
    """A step's metadata and cache: `groups` = [(prefix_len, [(q_len, own_len), ...])], lone =
    [(q_len, seq_len)] after them. Each prefix is stored once and heads every member's table."""

    def __init__(self, groups, lone=(), seed=0, empty_groups=0, pad_rows=0):
        gen = torch.Generator().manual_seed(seed)
        cdiv = triton.cdiv
        seqs = []                                            # (q_len, seq_len, prefix_len, group)
        for g, (prefix_len, members) in enumerate(groups):
            assert prefix_len % BLOCK == 0
            seqs += [(q_len, prefix_len + own, prefix_len, g) for q_len, own in members]
        seqs += [(q_len, n, 0, None) for q_len, n in lone]
        num_prefix_blocks = sum(p // BLOCK for p, _ in groups)
        num_blocks = num_prefix_blocks + sum(cdiv(n - p, BLOCK) for _, n, p, _ in seqs) + 8
        perm = torch.randperm(num_blocks, generator=gen)
        prefix_ids, used = [], 0
        for prefix_len, _ in groups:
            prefix_ids.append(perm[used:used + prefix_len // BLOCK])
            used += prefix_len // BLOCK
        max_blocks = max(cdiv(n, BLOCK) for _, n, _, _ in seqs)
        table = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
        for b, (_, n, p, g) in enumerate(seqs):
            own = cdiv(n, BLOCK) - p // BLOCK
            ids = torch.cat([prefix_ids[g] if g is not None else perm[:0], perm[used:used + own]])
            used += own
            table[b, :len(ids)] = ids.to(torch.int32)
        torch.manual_seed(seed)
        self.k = torch.randn(num_blocks, BLOCK, HKV, D, device=DEVICE, dtype=DTYPE)
        self.v = torch.randn(num_blocks, BLOCK, HKV, D, device=DEVICE, dtype=DTYPE)
        q_lens = [s[0] for s in seqs]
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        cu_groups = [0]
        for _, members in groups:
            cu_groups.append(cu_groups[-1] + len(members))
        cu_groups += [cu_groups[-1]] * empty_groups
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
        self.q = torch.randn(cu[-1] + pad_rows, HQ, D, device=DEVICE, dtype=DTYPE)
        self.table, self.cu, self.cu_groups = table.to(DEVICE), i32(cu), i32(cu_groups)
        self.lens, self.prefix_lens = i32([s[1] for s in seqs]), i32([s[2] for s in seqs])
        self.seqs, self.groups = seqs, groups
        self.max_seqlen_q = max(q_lens + [1])
        self.max_group_rows = max([sum(q for q, _ in m) for _, m in groups] + [1])
        self.max_prefix_len = max([p for p, _ in groups] + [0])
        self.max_seqlen_k = max(s[1] for s in seqs)

    def args(self):
        return (self.q, self.k, self.v, self.table, self.cu, self.lens, self.prefix_lens, self.cu_groups)

    def cascade(self, out=None, num_prefix_splits=None, **limits):
        sizes = dict(max_seqlen_q=self.max_seqlen_q, max_group_rows=self.max_group_rows,
                     max_prefix_len=self.max_prefix_len) | limits
        return cascade_attention(*self.args(), D ** -0.5, **sizes, num_prefix_splits=num_prefix_splits, out=out)

    def plain(self):
        return paged_attention(self.q, self.k, self.v, self.table, self.cu, self.lens, D ** -0.5,
                               max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k)

    def ref(self):
        """The reference on fp32 copies, left in fp32: the bf16 results' own rounding is error."""
        q, k, v, *meta = self.args()
        return cascade_attention_ref(q.float(), k.float(), v.float(), *meta, D ** -0.5)

    def torch_bf16(self):
        """The same attention by torch in bf16: SDPA per sequence over its gathered keys."""
        out = torch.zeros_like(self.q)
        cu, table = self.cu.tolist(), self.table
        for b, (q_len, n, _, _) in enumerate(self.seqs):
            if q_len == 0:
                continue
            blocks = table[b, :triton.cdiv(n, BLOCK)].long()
            k = self.k[blocks].reshape(-1, HKV, D)[:n].transpose(0, 1)          # [Hkv, n, D]
            v = self.v[blocks].reshape(-1, HKV, D)[:n].transpose(0, 1)
            q = self.q[cu[b]:cu[b + 1]].transpose(0, 1)                          # [Hq, q_len, D]
            k, v = k.repeat_interleave(HQ // HKV, 0), v.repeat_interleave(HQ // HKV, 0)
            visible = (torch.arange(n, device=DEVICE)[None, :]
                       <= torch.arange(n - q_len, n, device=DEVICE)[:, None])
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=D ** -0.5)
            out[cu[b]:cu[b + 1]] = o.transpose(0, 1)
        return out

    def kv_bytes(self, block_m: int) -> tuple[int, int]:
        """(plain, cascade) bytes of K and V each kernel's algorithm reads from the cache."""
        per_token = kv_bytes_per_token()
        plain = sum(n for _, n, _, _ in self.seqs) * per_token
        own = sum(n - p for _, n, p, _ in self.seqs) * per_token
        prefix = sum(triton.cdiv(sum(q for q, _ in m), block_m) * p for p, m in self.groups) * per_token
        return plain, own + prefix


def rel_err(got, ref) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def check_case(name, batch: Batch, out=None, rows: list | None = None, **run) -> dict:
    ref = batch.ref()
    if out is None:
        out = torch.full_like(batch.q, float("nan"))
        batch.cascade(out=out, **run)
    torch.cuda.synchronize()
    diff = (out.float() - ref.float()).abs()
    row = {"case": name, "rel_err": rel_err(out, ref), "torch_bf16_rel_err": rel_err(batch.torch_bf16(), ref),
           "plain_kernel_rel_err": rel_err(batch.plain(), ref), "max_abs_err": diff.max().item(),
           "num_bad": int((diff > ATOL + RTOL * ref.float().abs()).sum()), "num_nan": int(out.isnan().sum())}
    row["ok"] = (row["num_nan"] == 0 and row["num_bad"] == 0
                 and row["rel_err"] <= MAX_ERR_VS_TORCH * row["torch_bf16_rel_err"])
    print(f"  {name:<62} rel {row['rel_err']:.2e} | torch bf16 {row['torch_bf16_rel_err']:.2e} | plain "
          f"{row['plain_kernel_rel_err']:.2e} | max|err| {row['max_abs_err']:.1e}  {'ok' if row['ok'] else 'FAIL'}")
    if rows is not None:
        rows.append(row)
    return row


def decode_groups(group_size: int, prefix_len: int, num_rows: int = NUM_ROWS, own_len: int = OWN_LEN):
    return [(prefix_len, [(1, own_len)] * group_size) for _ in range(num_rows // group_size)]


def check_correctness() -> list[dict]:
    rows = []
    for size, prefix_len in ((16, 2000), (4, 496), (64, 8000)):
        check_case(f"decode {NUM_ROWS} rows, groups of {size}, prefix {prefix_len}, own {OWN_LEN}",
                   Batch(decode_groups(size, prefix_len), seed=size), rows=rows)
    mixed = [(2000, [(512, 512), (1, 200), (1, 37), (64, 300)] + [(1, 123)] * 12),
             (496, [(1, 5)] * 3 + [(300, 900)]),
             (128, [(1, 1)]),
             (8000, [(1, 200 + i) for i in range(40)])]
    lone = [(1, 3000), (700, 700), (1, 17), (0, 40), (5, 5)]
    check_case("mixed: prefill chunks + decodes in 4 groups, 5 lone, padding",
               Batch(mixed, lone, seed=1, pad_rows=7), rows=rows)
    for splits in (1, 4, 7):
        check_case(f"mixed, padded capacities, {splits} prefix splits",
                   Batch(mixed, lone, seed=2, empty_groups=60, pad_rows=3), rows=rows,
                   num_prefix_splits=splits, max_seqlen_q=1024, max_group_rows=1024, max_prefix_len=8192)

    # CUDA graph: no host sync while launching; capture once, change the step in place, replay.
    big, small = decode_groups(16, 2000, num_rows=64), (496, [(1, 100)] * 8)
    batch = Batch(big + [small], [(1, 900)] * 8, seed=3, empty_groups=4)
    first, last = sum(len(m) for _, m in big), sum(len(m) for _, m in big + [small])
    limits = dict(max_seqlen_q=1, max_group_rows=16, max_prefix_len=2000, num_prefix_splits=3)
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch.cascade(**limits)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out = torch.empty_like(batch.q)
    graph, _ = capture_graph(lambda: batch.cascade(out=out, **limits))
    batch.lens.add_(1)                       # every sequence one token on (own blocks have room)
    batch.prefix_lens[first:last] = 0        # the 496-prefix group dissolves into lone requests
    batch.cu_groups[len(big) + 1:] = first
    batch.seqs = [(q, n + 1, p if b < first else 0, g) for b, (q, n, p, g) in enumerate(batch.seqs)]
    out.fill_(float("nan"))
    graph.replay()
    check_case("cuda graph replay: lengths +1, one group dissolved", batch, out=out, rows=rows)
    return rows


def bench_graph(fn, warmup_ms: int, rep_ms: int) -> float:
    graph, _ = capture_graph(fn)
    return triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def time_cases(warmup_ms, rep_ms) -> list[dict]:
    rows = []
    g_pad = triton.next_power_of_2(HQ // HKV)
    print(f"{'group':>5} {'prefix':>6} {'S':>2} | {'cascade us':>10} {'(prefix+own)':>15} {'GB/s':>6} | "
          f"{'plain us':>8} {'GB/s':>6} | {'speedup':>7} | rule: saved MiB  verdict  measured")
    for size in GROUP_SIZES:
        for prefix_len in PREFIX_LENS:
            batch = Batch(decode_groups(size, prefix_len), seed=size * 7 + prefix_len)
            cfg = ca._prefix_config(batch.max_group_rows, g_pad, D, DTYPE)
            block_m = max(cfg.block_q // g_pad, 1)
            num_groups = len(batch.groups)
            splits = ca.choose_num_prefix_splits(num_groups, triton.cdiv(batch.max_group_rows, block_m), HKV,
                                                 prefix_len, ca._num_sms(batch.q.device))
            cascade_ms = bench_graph(lambda: batch.cascade(num_prefix_splits=splits), warmup_ms, rep_ms)
            plain_ms = bench_graph(batch.plain, warmup_ms, rep_ms)
            parts = pass_args(batch, splits)
            prefix_ms = bench_graph(lambda: ca._launch_prefix(*parts, batch.max_group_rows, splits, cfg),
                                    warmup_ms, rep_ms)
            own_cfg = ca._own_config(1, D, DTYPE)
            ca._launch_prefix(*parts, batch.max_group_rows, splits, cfg)      # partials to merge
            own_ms = bench_graph(lambda: ca._launch_own(*parts, 1, splits, own_cfg), warmup_ms, rep_ms)
            plain_bytes, cascade_bytes = batch.kv_bytes(block_m)
            rule = CascadeCostRule(HQ, HKV, D, DTYPE.itemsize, num_prefix_splits=splits,
                                   rows_per_prefix_tile=block_m)
            pgroups = [PrefixGroup(size, prefix_len, size)] * num_groups
            verdict = rule.use_cascade(pgroups)
            saved = sum(rule.saved_bytes(g) for g in pgroups)
            plain_rate = plain_bytes / (plain_ms * 1e-3)
            row = {"group_size": size, "prefix_len": prefix_len, "own_len": OWN_LEN, "num_rows": NUM_ROWS,
                   "num_groups": num_groups, "num_prefix_splits": splits, "prefix_block_q": cfg.block_q,
                   "cascade_us": cascade_ms * 1e3, "prefix_pass_us": prefix_ms * 1e3, "own_pass_us": own_ms * 1e3,
                   "plain_us": plain_ms * 1e3, "speedup": plain_ms / cascade_ms,
                   "cascade_kv_bytes": cascade_bytes, "plain_kv_bytes": plain_bytes,
                   "cascade_GB_s": cascade_bytes / cascade_ms / 1e6, "plain_GB_s": plain_bytes / plain_ms / 1e6,
                   "rule_saved_bytes": saved, "rule_says_cascade": verdict,
                   "cascade_faster": cascade_ms < plain_ms,
                   # Time cascade spends beyond its bytes at the plain kernel's rate, in those bytes.
                   "overhead_bytes_at_plain_rate": (cascade_ms * 1e-3 - cascade_bytes / plain_rate) * plain_rate}
            row["rule_agrees"] = row["rule_says_cascade"] == row["cascade_faster"]
            rows.append(row)
            print(f"{size:>5} {prefix_len:>6} {splits:>2} | {row['cascade_us']:>10.1f} "
                  f"({row['prefix_pass_us']:>6.1f}+{row['own_pass_us']:>6.1f}) {row['cascade_GB_s']:>6.0f} | "
                  f"{row['plain_us']:>8.1f} {row['plain_GB_s']:>6.0f} | {row['speedup']:>6.2f}x | "
                  f"{saved / 2 ** 20:>10.1f}  {'cascade' if verdict else 'plain':<8} "
                  f"{'cascade' if row['cascade_faster'] else 'plain':<8}{'' if row['rule_agrees'] else ' DISAGREE'}")
            del batch
            torch.cuda.empty_cache()
    overheads = sorted(r["overhead_bytes_at_plain_rate"] for r in rows)
    print(f"cascade's cost beyond its bytes, at the plain kernel's rate: median "
          f"{statistics.median(overheads) / 2 ** 20:.1f} MiB (range {overheads[0] / 2 ** 20:.1f} .. "
          f"{overheads[-1] / 2 ** 20:.1f}); CascadeCostRule.min_saved_bytes is {CascadeCostRule(HQ, HKV, D).min_saved_bytes / 2 ** 20:.0f} MiB")
    return rows


def pass_args(batch: Batch, splits: int) -> tuple:
    """The arguments `_launch_prefix` / `_launch_own` take, with a workspace for `splits`."""
    t = batch.q.shape[0]
    part_m = torch.empty(splits, t, HQ, dtype=torch.float32, device=DEVICE)
    part_acc = torch.empty(splits, t, HQ, D, dtype=torch.float32, device=DEVICE)
    return (*batch.args(), torch.empty_like(batch.q), part_m, torch.empty_like(part_m), part_acc, D ** -0.5)


GROUP_SHAPES = ((4, 496), (16, 2000), (64, 8000))      # (members, prefix tokens) of the sweep's decode groups
# The key loop's forms (the kernels' PROMPT and I32 constexprs): (prompt, i32).
LOOP_FORMS = ((False, False), (True, False), (False, True), (True, True))
PREFIX_TILES = ((64, 4, 2), (64, 4, 3), (128, 4, 2), (32, 4, 2))       # keys a step, warps, stages
OWN_CONFIGS = [ca._TileConfig(16, n, w, st, prompt=pr) for n in (32, 64, 128) for w in (2, 4)
               for st in (1, 2, 3) for pr in (False, True)]


def parse_tiles(values: list[str]) -> tuple[tuple[int, int, int], ...]:
    """'KxWxS' strings (keys a step, warps, stages) as tuples."""
    tiles = tuple(tuple(int(x) for x in v.split("x")) for v in values)
    if any(len(t) != 3 or min(t) < 1 for t in tiles):
        raise ValueError(f"tiles are KEYSxWARPSxSTAGES with each >= 1, got {values}")
    return tiles


def sweep(warmup_ms, rep_ms, cases=("groups", "lone"), shapes=GROUP_SHAPES, num_rows=NUM_ROWS,
          prefix_tiles=PREFIX_TILES, own_configs=None, loop_forms=LOOP_FORMS, splits_list=(1, 2, 3, 4, 6)) -> list[dict]:
    """Each pass alone: the prefix pass over tile configs (at the tile height the rule picks for
    the group) x key-loop forms x split counts, then the decode own pass over tile configs x
    key-loop forms (with the prefix pass's default config and splits ahead of it). num_rows:
    the decode rows of the groups' batch (members of groups of each shape)."""
    rows = []
    g_pad = triton.next_power_of_2(HQ // HKV)
    own_configs = OWN_CONFIGS if own_configs is None else own_configs

    def timed(row, fn, nbytes):
        try:
            ms = bench_graph(fn, warmup_ms, rep_ms)
        except Exception as e:  # noqa: BLE001 - a config that does not fit is a result too
            rows.append(dict(row, error=str(e)[:200]))
            return
        rows.append(dict(row, us=ms * 1e3, GB_s=nbytes / ms / 1e6))

    def best(kind, size, prefix_len):
        done = [r for r in rows if r["pass"] == kind and r["group_size"] == size
                and r["prefix_len"] == prefix_len and "us" in r]
        b = min(done, key=lambda r: r["us"])
        print(f"  sweep {kind} pass, group {size} prefix {prefix_len}: best {b['cfg']} S={b['splits']} "
              f"{b['us']:.1f} us {b['GB_s']:.0f} GB/s (default {b['default_us']:.1f} us)", flush=True)
        for form in sorted({(r["cfg"]["prompt"], r["cfg"]["i32"]) for r in done}, key=str):
            f = min((r for r in done if (r["cfg"]["prompt"], r["cfg"]["i32"]) == form), key=lambda r: r["us"])
            print(f"    prompt={form[0]} i32={form[1]}: {f['us']:.1f} us at {f['cfg']['block_n']} keys, "
                  f"{f['cfg']['num_warps']} warps, {f['cfg']['num_stages']} stages, S={f['splits']}", flush=True)

    for size, prefix_len in shapes if "groups" in cases else ():
        batch = Batch(decode_groups(size, prefix_len, num_rows=num_rows), seed=size)
        base = {"group_size": size, "prefix_len": prefix_len, "num_rows": num_rows}
        per_token = kv_bytes_per_token()
        own_bytes = sum(n - p for _, n, p, _ in batch.seqs) * per_token
        default = ca._prefix_config(batch.max_group_rows, g_pad, D, DTYPE)
        default_splits = ca.choose_num_prefix_splits(
            len(batch.groups), triton.cdiv(batch.max_group_rows, max(default.block_q // g_pad, 1)), HKV,
            prefix_len, ca._num_sms(batch.q.device))
        parts = pass_args(batch, default_splits)
        default_ms = {
            "prefix": bench_graph(lambda: ca._launch_prefix(*parts, batch.max_group_rows, default_splits, default),
                                  warmup_ms, rep_ms),
            "own": bench_graph(lambda: ca._launch_own(*parts, 1, default_splits, ca._own_config(1, D, DTYPE)),
                               warmup_ms, rep_ms)}
        prefix_configs = [ca._TileConfig(default.block_q, n, w, st, prompt=pr, i32=i32)
                          for n, w, st in prefix_tiles for pr, i32 in loop_forms]
        for cfg in prefix_configs:
            block_m = cfg.block_q // g_pad
            prefix_bytes = batch.kv_bytes(block_m)[1] - own_bytes
            for splits in splits_list:
                p = pass_args(batch, splits)
                timed(dict(base, cfg=cfg.__dict__, splits=splits, default_us=default_ms["prefix"] * 1e3,
                           **{"pass": "prefix"}),
                      lambda: ca._launch_prefix(*p, batch.max_group_rows, splits, cfg), prefix_bytes)
        best("prefix", size, prefix_len)
        ca._launch_prefix(*parts, batch.max_group_rows, default_splits, default)   # partials to fold
        for cfg in own_configs:
            timed(dict(base, cfg=cfg.__dict__, splits=default_splits, default_us=default_ms["own"] * 1e3,
                       **{"pass": "own"}),
                  lambda: ca._launch_own(*parts, 1, default_splits, cfg), own_bytes)
        best("own", size, prefix_len)
    # The own pass is the whole attention of lone requests in a cascade step: long ones too.
    for num_lone, ctx in ((64, 2200), (8, 8000)) if "lone" in cases else ():
        batch = Batch(decode_groups(16, 2000, num_rows=64), [(1, ctx)] * num_lone, seed=ctx)
        splits = 4
        parts = pass_args(batch, splits)
        ca._launch_prefix(*parts, batch.max_group_rows, splits, ca._prefix_config(batch.max_group_rows, g_pad, D, DTYPE))
        own_bytes = sum(n - p for _, n, p, _ in batch.seqs) * kv_bytes_per_token()
        base = {"group_size": f"16 + {num_lone} lone", "prefix_len": ctx}
        default_us = bench_graph(lambda: ca._launch_own(*parts, 1, splits, ca._own_config(1, D, DTYPE)),
                                 warmup_ms, rep_ms) * 1e3
        for cfg in own_configs:
            timed(dict(base, cfg=cfg.__dict__, splits=splits, default_us=default_us, **{"pass": "own"}),
                  lambda: ca._launch_own(*parts, 1, splits, cfg), own_bytes)
        best("own", base["group_size"], ctx)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="directory for gpu_check_cascade.json and .txt")
    ap.add_argument("--warmup-ms", type=int, default=25, help="do_bench warm-up time per kernel")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench measuring time per kernel")
    ap.add_argument("--sweep", nargs="*", choices=["groups", "lone"], default=None,
                    help="also time tile configs of each pass (and the prefix pass's split counts): on "
                         "decode groups, and the own pass of lone requests beside a group (no value: both)")
    ap.add_argument("--sweep-shapes", nargs="+", default=None, metavar="MxP",
                    help="the decode groups the sweep times: members x prefix tokens (default: "
                         + " ".join(f"{m}x{p}" for m, p in GROUP_SHAPES) + ")")
    ap.add_argument("--sweep-rows", type=int, default=NUM_ROWS,
                    help=f"decode rows of the sweep's groups (default {NUM_ROWS})")
    ap.add_argument("--prefix-tiles", nargs="+", default=None, metavar="KxWxS",
                    help="prefix pass tiles: keys a step x warps x stages (default "
                         + " ".join("x".join(map(str, t)) for t in PREFIX_TILES) + ")")
    ap.add_argument("--own-tiles", nargs="+", default=None, metavar="KxWxS",
                    help="own pass decode tiles, each in the plain and the PROMPT loop (default: 36 configs)")
    ap.add_argument("--loop-forms", nargs="+", default=None, metavar="PROMPT,I32",
                    help="the prefix pass's key-loop forms as 0/1 pairs, e.g. 1,1 (default: all four)")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6], help="prefix split counts")
    ap.add_argument("--skip-timing", action="store_true")
    opts = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    os.makedirs(opts.out, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    info = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(),
            "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "block_size": BLOCK}, "dtype": str(DTYPE)}
    header = (f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
              f"triton {triton.__version__}; Hq {HQ} Hkv {HKV} D {D} block {BLOCK} {DTYPE}")
    print(header)
    results = {"info": info}
    print(f"correctness (bf16 vs the fp32 reference; pass: rel err <= {MAX_ERR_VS_TORCH}x torch's bf16, "
          f"atol {ATOL} rtol {RTOL}, no NaN):")
    results["correctness"] = check_correctness()
    if not opts.skip_timing:
        print(f"timing: {NUM_ROWS} decode rows, {OWN_LEN} own tokens each; do_bench median of CUDA-graph "
              f"replays, L2 flushed; GB/s = K/V bytes each algorithm reads / time (H200 HBM "
              f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s)")
        results["timing"] = time_cases(opts.warmup_ms, opts.rep_ms)
    if opts.sweep is not None:
        shapes = (GROUP_SHAPES if opts.sweep_shapes is None
                  else tuple(tuple(int(x) for x in v.split("x")) for v in opts.sweep_shapes))
        own = (None if opts.own_tiles is None else
               [ca._TileConfig(16, n, w, st, prompt=pr) for n, w, st in parse_tiles(opts.own_tiles)
                for pr in (False, True)])
        forms = (LOOP_FORMS if opts.loop_forms is None else
                 tuple(tuple(bool(int(x)) for x in v.split(",")) for v in opts.loop_forms))
        results["sweep"] = sweep(opts.warmup_ms, opts.rep_ms, opts.sweep or ("groups", "lone"), shapes,
                                 opts.sweep_rows,
                                 PREFIX_TILES if opts.prefix_tiles is None else parse_tiles(opts.prefix_tiles),
                                 own, forms, tuple(opts.splits))
    json_path = os.path.join(opts.out, "gpu_check_cascade.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(opts.out, "gpu_check_cascade.txt"), "w") as f:
        f.write(header + "\n" + summary(results))
    bad = [r["case"] for r in results["correctness"] if not r["ok"]]
    print(f"wrote {json_path}; correctness: {'all ok' if not bad else 'FAILED: ' + ', '.join(bad)}")
    if bad:
        raise SystemExit(1)


def summary(results: dict) -> str:
    lines = ["correctness (rel err | torch bf16 | plain kernel):"]
    for r in results["correctness"]:
        lines.append(f"  {r['case']:<62} {r['rel_err']:.2e} | {r['torch_bf16_rel_err']:.2e} | "
                     f"{r['plain_kernel_rel_err']:.2e}  {'ok' if r['ok'] else 'FAIL'}")
    if "timing" in results:
        lines.append("group prefix S  cascade_us (prefix+own)  GB/s  plain_us  GB/s  speedup  rule  faster")
        for r in results["timing"]:
            lines.append(f"{r['group_size']:>5} {r['prefix_len']:>6} {r['num_prefix_splits']:>2} "
                         f"{r['cascade_us']:>10.1f} ({r['prefix_pass_us']:.1f}+{r['own_pass_us']:.1f}) "
                         f"{r['cascade_GB_s']:>5.0f} {r['plain_us']:>9.1f} {r['plain_GB_s']:>5.0f} "
                         f"{r['speedup']:>6.2f}x  {'cascade' if r['rule_says_cascade'] else 'plain'}  "
                         f"{'cascade' if r['cascade_faster'] else 'plain'}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
