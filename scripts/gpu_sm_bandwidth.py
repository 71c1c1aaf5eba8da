"""How much of HBM's bandwidth can a few SMs pull? (issue 13's overlap question)

intake_and_overlap.md section 5 found that decode attention beside another batch's GEMMs (the
GEMMs told by cuBLASLt's carveout to leave SMs free) does not take up the slack: our attention
launches more programs than fit and takes whatever SMs free up. For that overlap to pay, the
attention would have to hold only the carved SMs (a persistent kernel) and still read near the
device copy's rate from them. The second half had not been measured: this probe measures it.

A streaming read: `programs` programs (at most the 132 SMs; the block scheduler spreads them
over SMs first, and the SM ids they ran on are recorded), each summing its own contiguous part of
a ~7 GB bf16 buffer, far beyond L2, checked against torch's sums. Forms:
  ptr   pointer loads of [rows, 128] tiles, `tl.range(num_stages=...)`
  tma   TMA tensor-descriptor loads of [rows, 128] tiles, pipelined `num_stages` deep
Each (programs, form) is timed with triton's do_bench (median); the rate is the buffer's bytes
over that time, beside a device copy of the same bytes (torch, all SMs).

--patterns: the same read over a ~3.5 GB buffer laid out as a KV cache, [tokens, 8 heads, 128],
each program reading one head's 256-byte rows over its own run of tokens (int32 offsets, as the
decode kernel uses):
  contig  the buffer as plain rows (no heads), the same kernel: the ceiling
  heads   tokens in order, every 8th row (the plain decode kernel's pattern without pages)
  paged   tokens in 16-token pages at random places, found through a block table loaded in the
          loop (the decode kernel's pattern exactly)
at 128 (one an SM), 256 and 2,048 (one a (sequence, head), as a 256-row decode call) programs.

    PYTHONPATH=. python3 scripts/gpu_sm_bandwidth.py --out $OUT/sm_bandwidth.json
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COLS = 128                                   # a tile row: 128 bf16 = 256 bytes (one head's key)
PROGRAMS = (8, 16, 24, 32, 48, 66, 100, 132)
# (name, form, tile rows, warps, stages)
FORMS = [
    ("ptr r64 w8 s1", "ptr", 64, 8, 1), ("ptr r64 w8 s3", "ptr", 64, 8, 3), ("ptr r64 w8 s4", "ptr", 64, 8, 4),
    ("ptr r128 w16 s3", "ptr", 128, 16, 3),
    ("tma r64 w4 s4", "tma", 64, 4, 4), ("tma r64 w4 s8", "tma", 64, 4, 8), ("tma r128 w8 s4", "tma", 128, 8, 4),
    ("tma r128 w8 s6", "tma", 128, 8, 6), ("tma r256 w8 s3", "tma", 256, 8, 3),
]


@triton.jit
def _smid(pid):
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _stream_kernel(x_ptr, sums_ptr, sm_ptr, total_rows, rows_a_program,
                   TMA: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, STAGES: tl.constexpr,
                   SMID: tl.constexpr):
    """Program p sums rows [p * rows_a_program, (p + 1) * rows_a_program) of x [total_rows, COLS]."""
    pid = tl.program_id(0)
    first = pid * rows_a_program
    acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
    if TMA:
        desc = tl.make_tensor_descriptor(x_ptr, shape=[total_rows, COLS], strides=[COLS, 1],
                                         block_shape=[ROWS, COLS])
        for r in tl.range(0, rows_a_program, ROWS, num_stages=STAGES):
            acc += desc.load([first + r, 0]).to(tl.float32)
    else:
        offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
        base = x_ptr + first.to(tl.int64) * COLS
        for r in tl.range(0, rows_a_program, ROWS, num_stages=STAGES):
            acc += tl.load(base + r * COLS + offs).to(tl.float32)
    tl.store(sums_ptr + pid, tl.sum(acc))
    if SMID:
        tl.store(sm_ptr + pid, _smid(pid))


@triton.jit
def _pattern_kernel(x_ptr, table_ptr, sums_ptr, tokens_a_program, PAGED: tl.constexpr, HEADS: tl.constexpr,
                    ROWS: tl.constexpr, COLS: tl.constexpr, PAGE: tl.constexpr, STAGES: tl.constexpr):
    """Program p sums head p % HEADS of tokens [(p // HEADS) * tokens_a_program, + tokens_a_program)
    of x [tokens, HEADS, COLS]; PAGED: logical token t is at table[t // PAGE] * PAGE + t % PAGE."""
    pid = tl.program_id(0)
    head = pid % HEADS
    first = (pid // HEADS) * tokens_a_program
    cols = tl.arange(0, COLS)[None, :]
    acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
    for r in tl.range(0, tokens_a_program, ROWS, num_stages=STAGES):
        tok = first + r + tl.arange(0, ROWS)
        if PAGED:
            tok = tl.load(table_ptr + tok // PAGE) * PAGE + tok % PAGE
        acc += tl.load(x_ptr + ((tok * HEADS + head) * COLS)[:, None] + cols).to(tl.float32)
    tl.store(sums_ptr + pid, tl.sum(acc))


PATTERN_PROGRAMS = (128, 256, 2048)
PAGE = 16
# (name, tile rows, warps, stages)
PATTERN_FORMS = [("ptr r32 w4 s4", 32, 4, 4), ("ptr r64 w4 s3", 64, 4, 3), ("ptr r64 w8 s4", 64, 8, 4),
                 ("ptr r128 w8 s3", 128, 8, 3), ("ptr r128 w16 s3", 128, 16, 3),
                 ("ptr r64 w8 s8", 64, 8, 8), ("ptr r128 w8 s6", 128, 8, 6)]


def pattern_sums(x: torch.Tensor, table: torch.Tensor | None, programs: int, rows: int, warps: int,
                 stages: int) -> torch.Tensor:
    """Each program's sum (program p: head p % H of its run of tokens) of x [tokens, H, COLS], through
    the page table when one is given."""
    tokens, heads, cols = x.shape
    parts = programs // heads
    if cols != COLS or programs % heads or tokens % (parts * rows) or (table is not None and rows % PAGE):
        raise ValueError(f"x must be [T, H, {COLS}], programs a multiple of H, T a multiple of parts * rows")
    if x.numel() >= 2**31:
        raise ValueError("the pattern kernel takes int32 offsets: x must hold fewer than 2**31 values")
    sums = torch.empty(programs, dtype=torch.float32, device=x.device)
    _pattern_kernel[(programs,)](x, table if table is not None else sums, sums, tokens // parts,
                                 PAGED=table is not None, HEADS=heads, ROWS=rows, COLS=COLS, PAGE=PAGE,
                                 STAGES=stages, num_warps=warps)
    return sums


def expected_pattern_sums(x: torch.Tensor, table: torch.Tensor | None, programs: int) -> torch.Tensor:
    """pattern_sums by torch."""
    tokens, heads, _ = x.shape
    if table is not None:
        tok = torch.arange(tokens, device=x.device)
        x = x[table.long()[tok // PAGE] * PAGE + tok % PAGE]
    return torch.sum(x.view(programs // heads, -1, heads, COLS), dim=(1, 3), dtype=torch.float32).flatten()


def stream_sums(x: torch.Tensor, programs: int, form: str, rows: int, warps: int, stages: int,
                smid: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(each program's sum of its part of x [R, COLS], the SM each ran on or -1). R must split into
    `programs` parts of whole `rows`-row tiles."""
    total_rows = x.shape[0]
    if x.shape[1] != COLS or total_rows % (programs * rows):
        raise ValueError(f"x must be [R, {COLS}] with R a multiple of programs * rows = {programs * rows}")
    sums = torch.empty(programs, dtype=torch.float32, device=x.device)
    sm = torch.full((programs,), -1, dtype=torch.int32, device=x.device)
    _stream_kernel[(programs,)](x, sums, sm, total_rows, total_rows // programs, TMA=form == "tma", ROWS=rows,
                                COLS=COLS, STAGES=stages, SMID=smid, num_warps=warps)
    return sums, sm


def pattern_sweep(programs_list, form_names) -> list[dict]:
    import triton.testing

    tokens = (2**31 - 1) // (8 * COLS) // (256 * 128) * (256 * 128)      # int32 offsets; whole tiles
    x = torch.randn(tokens, 8, COLS, device="cuda", dtype=torch.bfloat16)
    nbytes = x.numel() * x.element_size()
    table = torch.randperm(tokens // PAGE, device="cuda").to(torch.int32)
    print(f"patterns: {nbytes / 2**30:.2f} GiB as [{tokens}, 8, {COLS}]", flush=True)
    out = []
    for pattern in ("contig", "heads", "paged"):
        data = x.view(-1, 1, COLS) if pattern == "contig" else x
        tab = table if pattern == "paged" else None
        for programs in programs_list:
            expect = expected_pattern_sums(data, tab, programs)
            for name, rows, warps, stages in [f for f in PATTERN_FORMS if f[0] in form_names]:
                sums = pattern_sums(data, tab, programs, rows, warps, stages)
                ok = bool(torch.allclose(sums, expect, rtol=1e-5, atol=8.0))
                ms = triton.testing.do_bench(lambda: pattern_sums(data, tab, programs, rows, warps, stages),
                                             warmup=5, rep=50, return_mode="median")
                r = dict(pattern=pattern, programs=programs, form=name, ms=ms, TB_s=nbytes / ms / 1e9,
                         sums_match=ok)
                out.append(r)
                print(f"{pattern:6s} {programs:5d} programs {name:16s} {ms:7.3f} ms {r['TB_s']:5.2f} TB/s"
                      f"  sums {'ok' if ok else 'WRONG'}", flush=True)
            del expect
    del x
    torch.cuda.empty_cache()
    return out


def main() -> None:
    import triton.testing

    from scripts.bench_common import write_probe

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--patterns", action="store_true", help="the KV-cache access patterns' sweep (below)")
    ap.add_argument("--pattern-programs", type=int, nargs="+", default=list(PATTERN_PROGRAMS))
    ap.add_argument("--pattern-forms", nargs="+", default=[f[0] for f in PATTERN_FORMS],
                    choices=[f[0] for f in PATTERN_FORMS])
    ap.add_argument("--skip-programs", action="store_true", help="not the sweep over program counts")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    pattern_rows = pattern_sweep(args.pattern_programs, args.pattern_forms) if args.patterns else []
    if args.skip_programs:
        write_probe(args.out, pattern_rows)
        return
    unit_rows = math.lcm(*PROGRAMS) * max(f[2] for f in FORMS)   # whole tiles for every program count
    total_rows = int(args.gib * 2**30 / (COLS * 2)) // unit_rows * unit_rows
    x = torch.randn(total_rows, COLS, device="cuda", dtype=torch.bfloat16)
    nbytes = x.numel() * x.element_size()
    copy_dst = torch.empty_like(x)
    copy_ms = triton.testing.do_bench(lambda: copy_dst.copy_(x), warmup=5, rep=50, return_mode="median")
    copy_tb_s = 2 * nbytes / copy_ms / 1e9          # read + write
    print(f"buffer {nbytes / 2**30:.2f} GiB; device copy {copy_tb_s:.2f} TB/s (read + write)", flush=True)
    del copy_dst
    # each of the finest parts' sums, from which every program count's expected sums are added up
    finest = torch.sum(x.view(math.lcm(*PROGRAMS), -1), dim=1, dtype=torch.float32)
    rows_out = []
    for programs in PROGRAMS:
        for name, form, rows, warps, stages in FORMS:
            try:
                try:
                    sums, sm = stream_sums(x, programs, form, rows, warps, stages, smid=True)
                except Exception:           # the SM-id read, should it not compile: time without it
                    sums, sm = stream_sums(x, programs, form, rows, warps, stages)
            except Exception as e:          # a config that does not compile (shared memory): say so, go on
                rows_out.append(dict(programs=programs, form=name, error=f"{type(e).__name__}: {e}"[:300]))
                print(f"{programs:4d} programs {name:18s} error {rows_out[-1]['error']}", flush=True)
                continue
            expect = finest.view(programs, -1).sum(1)
            ok = bool(torch.allclose(sums, expect, rtol=1e-5, atol=8.0))   # a lost tile is off by ~90
            ms = triton.testing.do_bench(lambda: stream_sums(x, programs, form, rows, warps, stages),
                                         warmup=3, rep=40, return_mode="median")
            r = dict(programs=programs, form=name, ms=ms, TB_s=nbytes / ms / 1e9,
                     distinct_sms=int(sm.unique().numel()) if int(sm.min()) >= 0 else None, sums_match=ok)
            rows_out.append(r)
            print(f"{programs:4d} programs {name:18s} {ms:8.3f} ms {r['TB_s']:5.2f} TB/s  on {r['distinct_sms']} SMs"
                  f"  sums {'ok' if ok else 'WRONG'}", flush=True)
    best = {}
    for r in rows_out:
        if r.get("sums_match") and r["TB_s"] > best.get(r["programs"], {}).get("TB_s", 0):
            best[r["programs"]] = r
    for p, r in sorted(best.items()):
        print(f"best at {p:4d} programs: {r['TB_s']:.2f} TB/s ({r['form']}), {r['TB_s'] / p * 1e3:.1f} GB/s an SM")
    write_probe(args.out, pattern_rows + rows_out, buffer_bytes=nbytes, device_copy_TB_s=copy_tb_s,
                best={str(p): r for p, r in best.items()})


if __name__ == "__main__":
    main()
