"""A probe, not used by the engine (benchmarks/h200/decode_attention_forms.md): decode attention
that reads the KV cache a page region at a time, every kv head at once. Kept as run; on the H200
it ran at <= 3.74 TB/s where the plain kernel runs at 4.1-4.25.

The same attention as `kernels/paged_attention.py` for decode calls (every sequence has at most
one query row), the same inputs and layouts. There a program owns one kv head, so it reads 256
bytes (one key's head, bf16 D=128) every 2 KB (the cache's [block, slot, kv head, D] row of a
key): scattered 256-byte pieces. Here a program owns one sequence (or a split of its keys) and
every head: a step reads KEYS consecutive keys of one block, all kv heads, KEYS * Hkv * D
contiguous values of K and of V (16 KB each at 8 keys of Llama-8B).

All Hq query rows of the token are one tile (H_PAD rows); the step's K tile is [KEYS * Hkv] keys
x heads (column c: key c // Hkv, kv head c % Hkv). A row sees only its kv head's columns, so
S = q K^T is computed whole and the other heads' columns are masked (-inf): Hkv times the
useful math, which the tensor cores absorb (a decode step is bound by the bytes).

Split-KV (num_kv_splits S > 1): the keys are cut into S ranges of whole steps; each program
stores its fp32 partials and the last to arrive (an arrival counter per sequence) merges them,
as the plain kernel's merge_in_kernel does (`_merge_splits`, the same order, so the same bits
whichever is last).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.arrival_counters import arrival_counters
from kernels.paged_attention import _LOG2E, _MAX, _SUM, _merge_splits, _num_sms, _q_for_keys

__all__ = ["page_decode_attention"]


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "stride_bt"])
def _page_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr, count_ptr,
    block_table_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
    qk_scale, sliding_window, num_seqs, num_tokens,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, KEYS: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    if USE_PDL:     # kernels/pdl.py: the kernel ahead is done before anything is read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    seq = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    COLS: tl.constexpr = KEYS * NUM_KV_HEADS
    rows = tl.arange(0, H_PAD)                  # query head
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = rows < NUM_HEADS

    if seq == num_seqs:
        # Padding rows past cu_seqlens_q[-1] come back zero, as in the reference.
        if split == 0:
            zeros = tl.full([H_PAD, HEAD_DIM], 0.0, dtype=out_ptr.dtype.element_ty)
            for t in range(tl.load(cu_seqlens_q_ptr + num_seqs).to(tl.int64), num_tokens):
                ptrs = out_ptr + t * stride_ot + rows[:, None] * stride_oh + offs_d[None, :] * stride_od
                tl.store(ptrs, zeros, mask=row_valid[:, None])
        return
    t = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    if tl.load(cu_seqlens_q_ptr + seq + 1) == t:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)

    # Keys [k_lo, k_hi) in whole steps; this split's share of them.
    k_lo = 0
    if HAS_WINDOW:
        k_lo = tl.maximum(seq_len - sliding_window, 0) // KEYS * KEYS
    k_hi = seq_len
    if NUM_SPLITS > 1:
        per = ((k_hi - k_lo + NUM_SPLITS - 1) // NUM_SPLITS + KEYS - 1) // KEYS * KEYS
        k_lo = k_lo + split * per
        k_hi = tl.maximum(tl.minimum(k_lo + per, k_hi), k_lo)       # may be empty

    q = tl.load(q_ptr + t * stride_qt + rows[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_valid[:, None], other=0.0)
    q = _q_for_keys(q, k_cache_ptr)
    cols = tl.arange(0, COLS)
    col_key = cols // NUM_KV_HEADS
    col_head = cols % NUM_KV_HEADS
    own_head = (rows // GROUP)[:, None] == col_head[None, :]
    k_offs = col_key[None, :] * stride_ks + col_head[None, :] * stride_kh + offs_d[:, None] * stride_kd   # [D, COLS]
    v_offs = col_key[:, None] * stride_vs + col_head[:, None] * stride_vh + offs_d[None, :] * stride_vd   # [COLS, D]
    table_row = block_table_ptr + seq * stride_bt
    m_i = tl.full([H_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.full([H_PAD], 0.0, dtype=tl.float32)
    acc = tl.full([H_PAD, HEAD_DIM], 0.0, dtype=tl.float32)
    for start in tl.range(k_lo, k_hi, KEYS, num_stages=NUM_STAGES):
        block = tl.load(table_row + start // PAGE_SIZE).to(tl.int64)
        slot0 = start % PAGE_SIZE
        key = start + col_key
        in_seq = key < seq_len
        k = tl.load(k_cache_ptr + block * stride_kb + slot0 * stride_ks + k_offs, mask=in_seq[None, :], other=0.0)
        v = tl.load(v_cache_ptr + block * stride_vb + slot0 * stride_vs + v_offs, mask=in_seq[:, None], other=0.0)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale          # [H_PAD, COLS]
        visible = own_head & in_seq[None, :]
        if HAS_WINDOW:
            visible = visible & (key > seq_len - 1 - sliding_window)[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_ptrs = out_ptr + t * stride_ot + rows[:, None] * stride_oh + offs_d[None, :] * stride_od
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        part0 = (t * NUM_HEADS + rows) * NUM_SPLITS
        part = part0 + split
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_valid[:, None])
        tl.debug_barrier()  # every thread's partial is stored before the release below
        arrived = tl.atomic_add(count_ptr + seq, 1, sem="acq_rel")
        if arrived == NUM_SPLITS - 1:           # the others' partials are all stored
            out = _merge_splits(part_m_ptr, part_l_ptr, part_acc_ptr, part0, row_valid, H_PAD, NUM_SPLITS,
                                HEAD_DIM)
            tl.atomic_xchg(count_ptr + seq, 0)
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def page_decode_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, scale: float,
                          sliding_window: int | None = None, *, num_kv_splits: int = 1, keys: int = 8,
                          num_warps: int = 4, num_stages: int = 3, pdl: bool = False) -> torch.Tensor:
    """Decode attention (every sequence has at most one query row) into out [T, Hq, D]; the
    same inputs as `kernels.paged_attention.paged_attention`, checked by it."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_kv_splits > 1:
        part_m = torch.empty(num_tokens, num_heads, num_kv_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_tokens, num_heads, num_kv_splits, head_dim, dtype=torch.float32,
                               device=q.device)
        counters = arrival_counters("page_decode", q.device, num_seqs)
    else:
        part_m = part_l = part_acc = out
        counters = block_table
    _page_decode_kernel[(num_seqs + 1, num_kv_splits)](
        q, k_cache, v_cache, out, part_m, part_l, part_acc, counters,
        block_table, cu_seqlens_q, seq_lens,
        scale * _LOG2E, sliding_window or 0, num_seqs, num_tokens,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), block_table.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, H_PAD=max(16, triton.next_power_of_2(num_heads)),
        HEAD_DIM=head_dim, PAGE_SIZE=block_size, KEYS=min(keys, block_size), NUM_SPLITS=num_kv_splits,
        HAS_WINDOW=sliding_window is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        USE_PDL=pdl, NUM_STAGES=num_stages, num_warps=num_warps,
    )
    return out
