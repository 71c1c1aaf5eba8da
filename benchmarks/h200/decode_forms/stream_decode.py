"""A probe, not used by the engine (benchmarks/h200/decode_attention_forms.md): decode attention as
one stream of key tiles per program (persistent, split evenly). Form 3 of four, kept as run;
on the H200 it ran at ~3.7 TB/s where the plain kernel runs at 4.1-4.25.

The same attention as `kernels/paged_attention.py` for decode calls (every sequence has at most
one query row): out[h] = softmax(scale * q[h] . k[:, h // G]) v[:, h // G] over the sequence's
keys (its window's, given a sliding window), fp32 online softmax, the same inputs and layouts.

Why another kernel. The plain kernel runs a program per (sequence, kv head): 2,048 programs for
256 rows of 8 kv heads, a few per SM at a time. Each program pays for its start (the first
loads wait on nothing to overlap with) and the last wave leaves SMs idle; with ~1,500 keys a
program that was ~18 us a call of 256 rows (H200: 250 us at 1,000 keys, 482 at 2,000,
the cost of 1,000 more keys 232 us; benchmarks/h200/one_loop.md), ~5% of the call.

Here a fixed number of programs (a few per SM) share the call's key tiles evenly. All (sequence,
kv head) items' tiles of BLOCK_N keys are laid end to end, item by item:

    tiles(s) = cdiv(seq_len, BLOCK_N) - first tile (0, or the window's), at least 1
    item (s, h) = tiles j in [Hkv * C_s + h * tiles(s), + tiles(s)),  C_s = sum_{s' < s} tiles(s')

and program p walks tiles [p * per, (p + 1) * per), per = cdiv(total, programs), in one loop
whose loads the compiler pipelines across item boundaries. At an item's first tile the running
(m, l, acc) restart; at its last tile the program writes the output, or, where the item began
before the program's range, an fp32 partial. An item cut by a range boundary (at most two a
program) is merged by whichever of its programs arrives last (an arrival counter per item, as
the split kernel does): pieces in program order, so the bits do not depend on which arrived
last. Program p's partial of the item its range starts in goes to slot 2p, of the item it ends
in (when another) to slot 2p + 1.

Each program first sums the tiles of every sequence (a scan over seq_lens, SEQ_CHUNK at a
time) to find its range and where it starts. Rows past cu_seqlens_q[-1] come back zero.
CUDA graphs: nothing is read on the host; the partial workspace is a torch.empty per call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.arrival_counters import arrival_counters
from kernels.paged_attention import (_LOG2E, _SUM, _int32_offsets, _kv_tiles, _num_sms, _online_step,
                                     _q_for_keys)

__all__ = ["stream_decode_attention"]

_SEQ_CHUNK = 256


@triton.jit
def _seq_tiles(seq_len, sliding_window, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(first tile, tiles) of a decode row's keys: BLOCK_N keys a tile, at least one tile."""
    hi = (seq_len + BLOCK_N - 1) // BLOCK_N
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - sliding_window, 0) // BLOCK_N
    return lo, tl.maximum(hi - lo, 1)


@triton.jit
def _merge_pieces(part_m_ptr, part_l_ptr, part_acc_ptr, item_start, per, p_first, p_last, rows,
                  BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The merged fp32 [BLOCK_Q, D] of an item's partials, programs p_first..p_last in order:
    sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p. Loads skip L1: other SMs wrote them."""
    offs_d = tl.arange(0, HEAD_DIM)
    m_max = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    for p in range(p_first, p_last + 1):
        slot = 2 * p + (item_start > p * per).to(tl.int64)
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + slot * BLOCK_Q + rows, cache_modifier=".cg"))
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.full([BLOCK_Q], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_Q, HEAD_DIM], 0.0, dtype=tl.float32)
    for p in range(p_first, p_last + 1):
        slot = 2 * p + (item_start > p * per).to(tl.int64)
        w = tl.exp2(tl.load(part_m_ptr + slot * BLOCK_Q + rows, cache_modifier=".cg") - m_max)
        l_sum += w * tl.load(part_l_ptr + slot * BLOCK_Q + rows, cache_modifier=".cg")
        acc += w[:, None] * tl.load(part_acc_ptr + (slot * BLOCK_Q + rows)[:, None] * HEAD_DIM + offs_d[None, :],
                                    cache_modifier=".cg")
    return acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]


@triton.jit
def _finish_cut_item(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, count_ptr, cu_seqlens_q_ptr, seq, kv_head,
                     num_kv_heads, item_start, item_tiles, per, rows, stride_ot, stride_oh, stride_od,
                     GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Arrive at a cut item's counter (this program's partial is stored); the last of its
    programs to arrive merges the pieces, writes the output and sets the counter back to 0."""
    p_first = item_start // per
    p_last = (item_start + item_tiles - 1) // per
    tl.debug_barrier()      # every thread's partial is stored before the release below
    counter = count_ptr + seq * num_kv_heads + kv_head
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == p_last - p_first:
        out = _merge_pieces(part_m_ptr, part_l_ptr, part_acc_ptr, item_start, per, p_first, p_last, rows,
                            BLOCK_Q, HEAD_DIM)
        tl.atomic_xchg(counter, 0)
        row = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
        valid = (rows < GROUP) & (tl.load(cu_seqlens_q_ptr + seq + 1) > row)
        offs_d = tl.arange(0, HEAD_DIM)
        ptrs = (out_ptr + row * stride_ot + (kv_head * GROUP + rows)[:, None] * stride_oh
                + offs_d[None, :] * stride_od)
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "stride_bt"])
def _stream_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,              # [2 * programs, BLOCK_Q] x2, [.., D] fp32
    count_ptr,                                         # [B * Hkv] int32, zero
    block_table_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
    qk_scale, sliding_window, num_seqs, num_tokens, num_kv_heads,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SEQ_CHUNK: tl.constexpr, SEQS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, I32: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    if USE_PDL:     # kernels/pdl.py: the kernel ahead is done before anything is read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_Q)            # row r: query head kv_head * GROUP + r (r < GROUP)
    offs_d = tl.arange(0, HEAD_DIM)

    # Padding rows past cu_seqlens_q[-1] come back zero, as in the reference.
    tail = tl.load(cu_seqlens_q_ptr + num_seqs).to(tl.int64)
    zeros = tl.full([BLOCK_Q, HEAD_DIM], 0.0, dtype=out_ptr.dtype.element_ty)
    for t in range(tail + pid, num_tokens, programs):
        for h in range(0, num_kv_heads):
            ptrs = out_ptr + t * stride_ot + (h * GROUP + rows)[:, None] * stride_oh + offs_d[None, :] * stride_od
            tl.store(ptrs, zeros, mask=(rows < GROUP)[:, None])

    # Every program counts the call's tiles, then finds its range and the item it starts in.
    total = tl.full([], 0, dtype=tl.int64)
    for c in range(0, num_seqs, SEQ_CHUNK):
        offs = c + tl.arange(0, SEQ_CHUNK)
        lens = tl.load(seq_lens_ptr + offs, mask=offs < num_seqs, other=1)
        n = tl.where(offs < num_seqs, _seq_tiles(lens, sliding_window, BLOCK_N, HAS_WINDOW)[1], 0)
        total += tl.reduce(n.to(tl.int64), 0, _SUM)
    total = total * num_kv_heads
    per = (total + programs - 1) // programs
    j0 = pid * per
    j1 = tl.minimum(j0 + per, total)
    if j0 >= j1:
        return
    seq = tl.full([], 0, dtype=tl.int64)      # items wholly before j0 belong to sequences < seq
    before = tl.full([], 0, dtype=tl.int64)   # tiles of those sequences, per kv head
    counted = tl.full([], 0, dtype=tl.int64)
    for c in range(0, num_seqs, SEQ_CHUNK):
        offs = c + tl.arange(0, SEQ_CHUNK)
        lens = tl.load(seq_lens_ptr + offs, mask=offs < num_seqs, other=1)
        n = tl.where(offs < num_seqs, _seq_tiles(lens, sliding_window, BLOCK_N, HAS_WINDOW)[1], 0).to(tl.int64)
        done = (tl.associative_scan(n, 0, _SUM) + counted) * num_kv_heads <= j0
        seq += tl.reduce(done.to(tl.int64), 0, _SUM)
        before += tl.reduce(tl.where(done, n, 0), 0, _SUM)
        counted += tl.reduce(n, 0, _SUM)

    first_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    first_tiles = _seq_tiles(first_len, sliding_window, BLOCK_N, HAS_WINDOW)[1]
    first_rel = j0 - before * num_kv_heads
    first_seq, first_head = seq, first_rel // first_tiles
    first_start = j0 - first_rel % first_tiles

    offs_n = tl.arange(0, BLOCK_N)
    lanes = tl.arange(0, SEQS)
    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_Q], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_Q, HEAD_DIM], 0.0, dtype=tl.float32)
    # Segments of SEQS sequences: each reads its sequences' lengths and rows once into
    # registers, and its tiles' addresses come from the tile index and those alone (no load in
    # the walk: the compiler pipelines the block ids and the keys as in the plain kernel).
    seg_seq = seq
    seg_base = before * num_kv_heads            # the flat index of seg_seq's first tile
    j = j0
    last_seq, last_head, last_start, last_tiles = seq, first_head, first_start, first_tiles
    while j < j1:
        offs = seg_seq + lanes
        in_range = offs < num_seqs
        lens = tl.load(seq_lens_ptr + offs, mask=in_range, other=1).to(tl.int64)
        n = tl.where(in_range, _seq_tiles(lens, sliding_window, BLOCK_N, HAS_WINDOW)[1], 0)
        starts = seg_base + num_kv_heads * (tl.associative_scan(n, 0, _SUM) - n)
        rows_lo = tl.load(cu_seqlens_q_ptr + offs, mask=in_range, other=0).to(tl.int64)
        rows_hi = tl.load(cu_seqlens_q_ptr + offs + 1, mask=in_range, other=0).to(tl.int64)
        seg_next = seg_base + num_kv_heads * tl.reduce(n, 0, _SUM)
        seg_end = tl.minimum(seg_next, j1)
        for jj in tl.range(j, seg_end, num_stages=NUM_STAGES):
            k_sel = tl.reduce(((starts <= jj) & in_range).to(tl.int32), 0, _SUM) - 1
            pick = lanes == k_sel
            seq = seg_seq + k_sel
            seq_len = tl.reduce(tl.where(pick, lens, 0), 0, _SUM)
            rel = jj - tl.reduce(tl.where(pick, starts, 0), 0, _SUM)
            row = tl.reduce(tl.where(pick, rows_lo, 0), 0, _SUM)
            q_len = tl.reduce(tl.where(pick, rows_hi, 0), 0, _SUM) - row
            lo, n_tiles = _seq_tiles(seq_len, sliding_window, BLOCK_N, HAS_WINDOW)
            kv_head = rel // n_tiles
            tile = rel % n_tiles
            row_valid = (rows < GROUP) & (q_len > 0)
            head = kv_head * GROUP + rows
            q = tl.load(q_ptr + row * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                        mask=row_valid[:, None], other=0.0)
            q = _q_for_keys(q, k_cache_ptr)
            k_start = (lo + tile) * BLOCK_N
            k, v = _kv_tiles(block_table_ptr + seq * stride_bt, k_cache_ptr + kv_head * stride_kh,
                             v_cache_ptr + kv_head * stride_vh, k_start, seq_len, stride_kb, stride_ks, stride_kd,
                             stride_vb, stride_vs, stride_vd, BLOCK_N, HEAD_DIM, PAGE_SIZE, True, I32)
            # An item's first tile restarts the running max, sum and accumulator (alpha comes to 0).
            restart = tile == 0
            m_i = tl.where(restart, float("-inf"), m_i)
            l_i = tl.where(restart, 0.0, l_i)
            q_pos = tl.full([BLOCK_Q], 0, dtype=tl.int64) + seq_len - 1
            acc, m_i, l_i = _online_step(acc, m_i, l_i, q, k, v, q_pos, k_start + offs_n, seq_len, qk_scale,
                                         sliding_window, True, False, HAS_WINDOW, DOT_PRECISION, False)
            last = tile == n_tiles - 1
            if last | (jj == j1 - 1):
                if last & (jj - tile >= j0):         # the whole item ran here
                    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
                    ptrs = out_ptr + row * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
                    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
                else:                               # a piece of a cut item
                    slot = 2 * pid + (jj - tile > j0).to(tl.int64)
                    tl.store(part_m_ptr + slot * BLOCK_Q + rows, m_i)
                    tl.store(part_l_ptr + slot * BLOCK_Q + rows, l_i)
                    tl.store(part_acc_ptr + (slot * BLOCK_Q + rows)[:, None] * HEAD_DIM + offs_d[None, :], acc)
            last_seq, last_head, last_start, last_tiles = seq, kv_head, jj - tile, n_tiles
        j = seg_end
        seg_seq += SEQS
        seg_base = seg_next

    # The items cut by this program's range: the one it starts in, and the one it ends in.
    if (first_start < j0) | (first_start + first_tiles > j1):
        _finish_cut_item(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, count_ptr, cu_seqlens_q_ptr,
                         first_seq, first_head, num_kv_heads, first_start, first_tiles, per, rows,
                         stride_ot, stride_oh, stride_od, GROUP, BLOCK_Q, HEAD_DIM)
    if (last_start + last_tiles > j1) & (last_start != first_start):
        _finish_cut_item(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, count_ptr, cu_seqlens_q_ptr,
                         last_seq, last_head, num_kv_heads, last_start, last_tiles, per, rows,
                         stride_ot, stride_oh, stride_od, GROUP, BLOCK_Q, HEAD_DIM)

def stream_decode_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, scale: float,
                            sliding_window: int | None = None, *, block_n: int = 128, num_warps: int = 4,
                            num_stages: int = 3, programs_per_sm: int = 2, programs: int | None = None,
                            seqs: int = 16, pdl: bool = False) -> torch.Tensor:
    """Decode attention (every sequence has at most one query row) into out [T, Hq, D]; the
    same inputs as `kernels.paged_attention.paged_attention`, checked by it."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    block_q = max(16, triton.next_power_of_2(group))
    programs = programs or programs_per_sm * _num_sms(q.device)
    part_m = torch.empty(2 * programs, block_q, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(2 * programs, block_q, head_dim, dtype=torch.float32, device=q.device)
    counters = arrival_counters("stream_decode", q.device, num_seqs * num_kv_heads)
    _stream_decode_kernel[(programs,)](
        q, k_cache, v_cache, out, part_m, part_l, part_acc, counters,
        block_table, cu_seqlens_q, seq_lens,
        scale * _LOG2E, sliding_window or 0, num_seqs, num_tokens, num_kv_heads,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), block_table.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_N=block_n, HEAD_DIM=head_dim, PAGE_SIZE=block_size,
        SEQ_CHUNK=_SEQ_CHUNK, SEQS=seqs, HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", USE_PDL=pdl,
        I32=_int32_offsets(k_cache, v_cache), NUM_STAGES=num_stages,
        num_warps=num_warps,
    )
    return out
