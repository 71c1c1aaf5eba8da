"""Cascade attention in Triton: a batch of many shared-prefix groups, each prefix read once per group.

Same math as `attention_ref.cascade_attention_ref` (re-exported here) and as plain paged attention:
every query row attends, in one softmax, to its sequence's [shared prefix + own] keys, causally
within the own part. What changes is how the keys are read. Layouts:

  q                [T, Hq, D]      new tokens of the B sequences back to back; any strides
  k_cache, v_cache [num_blocks, block_size, Hkv, D]   any strides (this project's paged cache), q's dtype or FP8
  block_table      [B, max_blocks] int32, unit stride along blocks: each sequence's whole
                                   context in position order, prefix blocks first
  cu_seqlens_q     [B + 1] int32   sequence b owns q rows cu_seqlens_q[b]:cu_seqlens_q[b + 1]
  seq_lens         [B] int32       context length of b including its new tokens
  prefix_lens      [B] int32       P_b: tokens of b's group prefix; 0: b reads everything alone
  cu_group_seqs    [max_groups + 1] int32   group g = sequences cu_group_seqs[g]:cu_group_seqs[g + 1]
  out              [T, Hq, D]      q's dtype; rows past cu_seqlens_q[-1] are written as zeros

Contract the caller keeps (checked by the reference, not here: that would read the device):
a group's members are consecutive sequences with one P, a multiple of block_size, whose first
P / block_size block table entries are the same blocks, and P <= the first query position of every
member (the prefix precedes all its rows; a request still writing the prefix is not a member).
Groups may be padded to a fixed capacity with empty groups (entries equal to the last one).
Lone requests have P = 0 and need no group: put them past cu_group_seqs[-1] (or in any group whose
P is 0). For them the kernel is exactly plain paged attention, all keys in the own pass, one
program per kv head (no split-KV): a long lone decode may instead be a group of one whose prefix
is its full cached blocks, so that its context is cut over the prefix splits.

Math. With scores s_j = scale * log2(e) * q . k_j (fp32) and, over a key set J,
m_J = max_j s_j, l_J = sum_j 2^(s_j - m_J), acc_J = sum_j 2^(s_j - m_J) v_j, the softmax over
J1 u J2 merges exactly: m = max(m1, m2), acc = 2^(m1-m) acc1 + 2^(m2-m) acc2 (same for l),
out = acc / l. J1 is the prefix (cut into S splits, each its own (m, l, acc)), J2 the own keys.

Pass 1, `_prefix_kernel`, grid (prefix tiles of the largest group, max_groups, Hkv * S). The
group's query rows (rows cu_seqlens_q[first member]:cu_seqlens_q[last member + 1], decode and
prefill rows alike, all see the whole prefix) times the G = Hq / Hkv query heads of one kv head
form the M side of one tl.dot: BLOCK_Q = BLOCK_M rows x G_PAD heads (row r = token r // G_PAD,
head r % G_PAD). Each program walks one split of the prefix through the first member's block
table and stores fp32 (m, l, acc) per (split, token row, head) to a workspace. So a prefix K/V
tile is read once per (group, kv head, split) when the group's rows fit one tile (BLOCK_M =
128 / G_PAD rows in bf16/fp16), and once per tile beyond that: cdiv(rows, BLOCK_M) times, not once
per member. No masks save the prefix's last partial key step.

Pass 2, `_own_kernel`, grid (query tiles of the longest q, B + 1, Hkv), like paged attention:
a program takes BLOCK_M positions of one sequence x the G heads of one kv head, attends to keys
[P_b, seq_len) through b's block table with the causal mask, then, when P_b > 0, folds in the S
prefix partials of its rows and writes out. The extra "sequence" B zeroes the padding rows.
A step of decode rows beside prompt chunks runs it twice (own_decode_seqs, own_prompt_seqs):
over the one-row sequences in decode tiles, and over the others in prompt tiles; each launch
maps its programs to the sequences it lists. In one launch the decode rows took prompt tiles 32
positions tall and the grid was every sequence times the longest prompt's tiles: on the H200 the
own pass took 356 us a layer in such steps of the RFC shared-prefix job (benchmarks/h200/
cascade_mixed_steps.md).

Side by side (`side_by_side=True`, a step without own lists): the prefix pass on a side stream
beside the own pass, which stores the partial of each row with a prefix in one more workspace
slot; then `_merge_kernel` folds the splits into it as the own pass would have (the same
operations in the same order: the same bits).

CUDA graphs. The launcher reads no device value: grids come from tensor shapes (B, T,
max_groups from the buffers' sizes) and host ints (max_seqlen_q, max_group_rows, S); programs
beyond a group's or sequence's rows exit at once. The workspace is a torch.empty per call, from
the graph's private pool under capture: S * T * Hq * (D + 2) * 4 bytes. Sliding windows are not
supported (a window may not reach the prefix): such models use the plain kernel.

The cost rule `CascadeCostRule` (kernels/cascade_cost.py, no torch) says per step which groups are
worth it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention_ref import cascade_attention_ref
from kernels.cascade_cost import CascadeCostRule, PrefixGroup
# The paged kernel's loop over keys: the same loads and math, so the same bits.
from kernels.paged_attention import _attend_keys, _int32_offsets, _prompt_loop, _q_for_keys, check_q_and_caches
from kernels.side_stream import side_stream

__all__ = ["cascade_attention", "cascade_attention_ref", "choose_num_prefix_splits",
           "prefix_rows_per_tile", "CascadeCostRule", "PrefixGroup"]

_LOG2E = 1.4426950408889634
_H200_NUM_SMS = 132
_MAX_GRID_YZ = 65535


# Step-to-step integers are not specialized on (see kernels/paged_attention.py).
@triton.jit(do_not_specialize=["num_tokens", "stride_bt"])
def _prefix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,              # [S, T, Hq] x2, [S, T, Hq, D] fp32
    block_table_ptr, cu_seqlens_q_ptr, prefix_lens_ptr, cu_group_seqs_ptr,
    qk_scale, num_tokens, num_heads,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, PROMPT: tl.constexpr, I32: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1).to(tl.int64)
    pid_hs = tl.program_id(2).to(tl.int64)
    kv_head = pid_hs // NUM_SPLITS
    split = pid_hs % NUM_SPLITS

    seq_lo = tl.load(cu_group_seqs_ptr + grp).to(tl.int64)
    seq_hi = tl.load(cu_group_seqs_ptr + grp + 1).to(tl.int64)
    if seq_hi <= seq_lo:                    # an empty (capacity padding) group
        return
    prefix_len = tl.load(prefix_lens_ptr + seq_lo).to(tl.int64)
    tile_lo = tl.load(cu_seqlens_q_ptr + seq_lo).to(tl.int64) + pid_m * BLOCK_M
    rows_hi = tl.load(cu_seqlens_q_ptr + seq_hi).to(tl.int64)
    if prefix_len == 0:
        return
    if tile_lo >= rows_hi:                  # past the group's last query row
        return

    rows = tl.arange(0, BLOCK_Q)
    t = tile_lo + rows // G_PAD             # token row of each tile row
    row_g = rows % G_PAD                    # query head inside the kv head's group
    head = kv_head * GROUP + row_g
    row_valid = (row_g < GROUP) & (t < rows_hi)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = _q_for_keys(tl.load(q_ptrs, mask=row_valid[:, None], other=0.0), k_cache_ptr)

    # This split's keys [k_lo, k_hi): whole BLOCK_N steps, the prefix's ragged end masked.
    per_split = ((prefix_len + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    k_lo = split * per_split
    k_hi = tl.maximum(tl.minimum(k_lo + per_split, prefix_len), k_lo)      # may be empty
    k_full_hi = k_lo + (k_hi - k_lo) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_Q], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_Q, HEAD_DIM], 0.0, dtype=tl.float32)
    table_row = block_table_ptr + seq_lo * stride_bt       # the first member's: the shared blocks
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, t, table_row, k_base, v_base, k_lo, k_full_hi, qk_scale, 0,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
        BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, MASKED=False, HAS_WINDOW=False,
        DOT_PRECISION=DOT_PRECISION, KV_AHEAD=False, CAUSAL=False, PROMPT=PROMPT, I32=I32)
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, t, table_row, k_base, v_base, k_full_hi, k_hi, qk_scale, 0,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
        BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, MASKED=True, HAS_WINDOW=False,
        DOT_PRECISION=DOT_PRECISION, KV_AHEAD=False, CAUSAL=False, PROMPT=PROMPT, I32=I32)

    # An empty split stores m = -inf, l = 0, acc = 0: it weighs nothing in the merge.
    part = (split * num_tokens + t) * num_heads + head
    tl.store(part_m_ptr + part, m_i, mask=row_valid)
    tl.store(part_l_ptr + part, l_i, mask=row_valid)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_m_tiles", "stride_bt", "num_listed"])
def _own_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    block_table_ptr, cu_seqlens_q_ptr, seq_lens_ptr, prefix_lens_ptr, seq_ids_ptr,
    qk_scale, num_seqs, num_tokens, num_heads, num_m_tiles, num_listed,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, PROMPT: tl.constexpr, I32: tl.constexpr,
    HAS_SEQ_IDS: tl.constexpr, OWN_PARTIAL: tl.constexpr, HAS_PREFIX: tl.constexpr,
):
    # Longest-running tiles (last positions of a prompt see the most keys) start first.
    pid_m = num_m_tiles - 1 - tl.program_id(0).to(tl.int64)
    seq = tl.program_id(1).to(tl.int64)
    if HAS_SEQ_IDS:     # the sequences listed in seq_ids; the program past the list pads
        listed = tl.load(seq_ids_ptr + tl.minimum(seq, num_listed - 1)).to(tl.int64)
        seq = tl.where(seq < num_listed, listed, num_seqs)
    kv_head = tl.program_id(2).to(tl.int64)

    rows = tl.arange(0, BLOCK_Q)
    row_pos = rows // G_PAD
    row_g = rows % G_PAD
    head = kv_head * GROUP + row_g
    offs_d = tl.arange(0, HEAD_DIM)

    if seq == num_seqs:
        # Padding rows past cu_seqlens_q[-1] come back zero, as in the reference.
        zeros = tl.full([BLOCK_Q, HEAD_DIM], 0.0, dtype=out_ptr.dtype.element_ty)
        tail_start = tl.load(cu_seqlens_q_ptr + num_seqs).to(tl.int64)
        for t0 in range(tail_start + pid_m * BLOCK_M, num_tokens, num_m_tiles * BLOCK_M):
            t = t0 + row_pos
            mask = (row_g < GROUP) & (t < num_tokens)
            ptrs = out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
            tl.store(ptrs, zeros, mask=mask[:, None])
        return

    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1).to(tl.int64) - q_start
    if pid_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    if HAS_PREFIX:
        # A whole number of pages (the contract), said to the compiler.
        prefix_len = tl.multiple_of(tl.load(prefix_lens_ptr + seq).to(tl.int64), PAGE_SIZE)
    else:
        # No listed sequence has a prefix: the key loops start at a literal 0, as the plain
        # kernel's do, and there is nothing to fold. On the H200's prompt tiles the same loops
        # from a prefix length read at run time (0) took 1.23-1.24x the time
        # (benchmarks/h200/cascade_side_by_side.md): the sm_90 code kept 255 registers
        # against 220 and ~1,000 more instructions, the fold's share of them small.
        prefix_len = 0

    first_pos = seq_len - q_len + pid_m * BLOCK_M   # position of the tile's first query
    row_in_seq = pid_m * BLOCK_M + row_pos
    row_valid = (row_g < GROUP) & (row_in_seq < q_len)
    q_pos = first_pos + row_pos
    t = q_start + row_in_seq
    q_ptrs = q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = _q_for_keys(tl.load(q_ptrs, mask=row_valid[:, None], other=0.0), k_cache_ptr)

    # Own keys [prefix_len, k_hi); [prefix_len, k_full_hi) is visible to every row (no mask),
    # whole BLOCK_N steps from prefix_len (a multiple of the page size, not of BLOCK_N).
    k_hi = tl.minimum(first_pos + BLOCK_M, seq_len)
    k_full_hi = prefix_len + tl.maximum(first_pos + 1 - prefix_len, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_Q], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_Q, HEAD_DIM], 0.0, dtype=tl.float32)
    table_row = block_table_ptr + seq * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, q_pos, table_row, k_base, v_base, prefix_len, k_full_hi, qk_scale, 0,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
        BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, MASKED=False, HAS_WINDOW=False,
        DOT_PRECISION=DOT_PRECISION, KV_AHEAD=False, CAUSAL=True, PROMPT=PROMPT, I32=I32)
    acc, m_i, l_i = _attend_keys(     # the causal diagonal and the sequence's last partial block
        acc, m_i, l_i, q, q_pos, table_row, k_base, v_base, k_full_hi, k_hi, qk_scale, 0,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
        BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, MASKED=True, HAS_WINDOW=False,
        DOT_PRECISION=DOT_PRECISION, KV_AHEAD=False, CAUSAL=True, PROMPT=PROMPT, I32=I32)

    if not HAS_PREFIX:
        _store_rows(out_ptr, acc, l_i, t, head, row_valid, stride_ot, stride_oh, stride_od, HEAD_DIM)
    elif OWN_PARTIAL:
        if prefix_len > 0:      # the prefix pass runs beside this one: `_merge_kernel` folds
            part = (NUM_SPLITS * num_tokens + t) * num_heads + head
            tl.store(part_m_ptr + part, m_i, mask=row_valid)
            tl.store(part_l_ptr + part, l_i, mask=row_valid)
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_valid[:, None])
        else:
            _store_rows(out_ptr, acc, l_i, t, head, row_valid, stride_ot, stride_oh, stride_od, HEAD_DIM)
    else:
        if prefix_len > 0:      # valid rows saw their own key, so m_i is finite
            acc, m_i, l_i = _fold_prefix(acc, m_i, l_i, part_m_ptr, part_l_ptr, part_acc_ptr, t, head,
                                         row_valid, num_tokens, num_heads, HEAD_DIM, NUM_SPLITS)
        _store_rows(out_ptr, acc, l_i, t, head, row_valid, stride_ot, stride_oh, stride_od, HEAD_DIM)


@triton.jit
def _fold_prefix(acc, m_i, l_i, part_m_ptr, part_l_ptr, part_acc_ptr, t, head, row_valid, num_tokens,
                 num_heads, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """(acc, m_i, l_i) of a tile's own keys with the prefix pass's NUM_SPLITS partials folded in,
    split 0 first."""
    offs_d = tl.arange(0, HEAD_DIM)
    for s in range(NUM_SPLITS):
        part = (s * num_tokens + t) * num_heads + head
        m_s = tl.load(part_m_ptr + part, mask=row_valid, other=float("-inf"))
        l_s = tl.load(part_l_ptr + part, mask=row_valid, other=0.0)
        acc_s = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=row_valid[:, None], other=0.0)
        m_new = tl.maximum(m_i, m_s)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        beta = tl.exp2(m_s - m_sub)
        # Explicit FMAs: the compiler may contract a * b + c * d either way round, and the own
        # pass and the merge kernel must round alike.
        acc = tl.fma(acc, alpha[:, None], acc_s * beta[:, None])
        l_i = tl.fma(l_i, alpha, l_s * beta)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _store_rows(out_ptr, acc, l_i, t, head, row_valid, stride_ot, stride_oh, stride_od, HEAD_DIM: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_ptrs = out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_tokens", "num_m_tiles"])
def _merge_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, cu_seqlens_q_ptr, prefix_lens_ptr,
    num_tokens, num_heads, num_m_tiles, stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """The own pass's partial (slot NUM_SPLITS) of each row with a prefix, the prefix splits
    folded in as `_own_kernel` folds them (the same operations in the same order: the same
    bits), written out. Grid (query tiles, B, Hkv), tiles as the own pass's."""
    pid_m = tl.program_id(0).to(tl.int64)
    seq = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2).to(tl.int64)
    if tl.load(prefix_lens_ptr + seq) == 0:
        return
    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int64)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1).to(tl.int64) - q_start
    if pid_m * BLOCK_M >= q_len:
        return
    rows = tl.arange(0, BLOCK_Q)
    row_g = rows % G_PAD
    head = kv_head * GROUP + row_g
    row_in_seq = pid_m * BLOCK_M + rows // G_PAD
    row_valid = (row_g < GROUP) & (row_in_seq < q_len)
    t = q_start + row_in_seq
    offs_d = tl.arange(0, HEAD_DIM)
    own = (NUM_SPLITS * num_tokens + t) * num_heads + head
    m_i = tl.load(part_m_ptr + own, mask=row_valid, other=float("-inf"))
    l_i = tl.load(part_l_ptr + own, mask=row_valid, other=0.0)
    acc = tl.load(part_acc_ptr + own[:, None] * HEAD_DIM + offs_d[None, :], mask=row_valid[:, None], other=0.0)
    acc, m_i, l_i = _fold_prefix(acc, m_i, l_i, part_m_ptr, part_l_ptr, part_acc_ptr, t, head,
                                 row_valid, num_tokens, num_heads, HEAD_DIM, NUM_SPLITS)
    _store_rows(out_ptr, acc, l_i, t, head, row_valid, stride_ot, stride_oh, stride_od, HEAD_DIM)


# triton.jit picked the interpreter (TRITON_INTERPRET=1 at import) or the compiler: an
# interpreted kernel runs on CPU tensors, a compiled one on CUDA tensors only.
_INTERPRETED = not isinstance(_own_kernel, triton.runtime.JITFunction)


@dataclass(frozen=True)
class _TileConfig:
    block_q: int        # target rows per tile (query positions x padded group)
    block_n: int        # keys per step
    num_warps: int
    num_stages: int
    prompt: bool | None = None      # the key loop's PROMPT form (block ids a step ahead); None: the pass's rule
    i32: bool | None = None         # int32 K/V offsets (where the caches allow them); None: the pass's rule


def _own_config(max_seqlen_q: int, head_dim: int, dtype: torch.dtype) -> _TileConfig:
    """Decode: 16-row tiles of 32-key steps on 2 warps, 3 stages, in the key loop's PROMPT form
    (block ids a step ahead; head dim 128). The own pass reads members' own keys (few, in the
    shared-prefix jobs cascade is for) and lone rows' whole contexts (up to 2048 cached tokens,
    longer ones where the prefix pass has no room: engine/cascade_plan.py). H200, 256 and 512
    rows (`gpu_check_cascade.py --sweep ... --own-tiles`, benchmarks/h200/cascade_decode_passes.md,
    thirty-fourth session), against the 64-key steps on 4 warps, 2 stages, plain loop, used
    before: members of 200 own keys in groups of 4 / 16 / 64, 4.3-6.2% faster (512 rows, groups
    of 16: 131.6 against 139.3 us); 64 lone rows of 2200 keys 3.1% faster; 8 lone rows of 8000
    keys 1.1% slower. (32-key steps on 2 warps in the plain loop, 2 stages, were within 5% of it
    either way for member batches, but 5.7% slower for groups of 64 x 8000 at 512 rows, 7% for the
    2200-key lone rows and 1.45-1.46x for the 8000-key ones.) Timed over bf16 caches; FP8 caches
    take the same tile (their decode loop was the PROMPT form already), correct on the GPU
    (tests/test_cascade_attention.py) but not timed in it.
    Prefill tiles as paged attention's (128 x 64 on 8 warps, the key loop's PROMPT form); small
    exact-fp32 tiles (a test path)."""
    if dtype == torch.float32:
        return _TileConfig(16, 16 if head_dim >= 128 else 32, 4, 2)
    if max_seqlen_q == 1:
        return _TileConfig(16, 32, 4, 3) if head_dim == 256 else _TileConfig(16, 32, 2, 3, prompt=True)
    if head_dim == 256:
        return _TileConfig(64, 32, 8, 2)
    return _TileConfig(128, 64, 8, 3)


def _prefix_config(max_group_rows: int, g_pad: int, head_dim: int, dtype: torch.dtype) -> _TileConfig:
    """As many of the largest group's rows x heads as fit one tile, up to 128: each K/V step then
    serves the whole group. Every row sees every key, so the tile is a dense GEMM-shaped loop.
    64-key steps on 4 warps. 64-row tiles (the decode graphs': 16 rows a group x 4 heads) read as
    prompt tiles do (the key loop's PROMPT form: block ids a step ahead; int32 offsets where the
    caches allow) on 3 stages; other heights the plain loop on 2 stages. H200 (`gpu_check_cascade.py
    --sweep groups`, benchmarks/h200/cascade_decode_passes.md), members a group x prefix tokens:
    at 16 x 2000 (64-row tiles) 49.5-50.4 us at 1-2 splits against 54.0 for the plain loop on 2
    stages, the earlier choice (from an H100 sweep); at 4 x 496 (16-row tiles) 47.5 against 54.4
    and at 64 x 8000 (128-row tiles) 112.2 against 131.7, the plain loop on 2 stages the faster."""
    if dtype == torch.float32:
        return _TileConfig(16, 16 if head_dim >= 128 else 32, 4, 2)
    rows = min(max(triton.next_power_of_2(max_group_rows * g_pad), 16), 128)
    if head_dim == 256:
        return _TileConfig(min(rows, 64), 32, 4 if rows <= 32 else 8, 2)
    if rows == 64:
        return _TileConfig(rows, 64, 4, 3, prompt=True, i32=True)
    return _TileConfig(rows, 64, 4, 2)


def prefix_rows_per_tile(max_group_rows: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype) -> int:
    """Query rows (tokens) one prefix program holds for a launch with this max_group_rows: a group
    of R rows reads its prefix cdiv(R, this) times (CascadeCostRule.rows_per_prefix_tile)."""
    g_pad = triton.next_power_of_2(num_q_heads // num_kv_heads)
    return max(_prefix_config(max_group_rows, g_pad, head_dim, dtype).block_q // g_pad, 1)


def choose_num_prefix_splits(num_groups: int, num_tiles_per_group: int, num_kv_heads: int,
                             max_prefix_len: int, num_sms: int = _H200_NUM_SMS,
                             min_keys_per_split: int = 256, max_splits: int = 16) -> int:
    """Splits of each prefix: as many prefix programs as fit two per SM (one wave; a second,
    partial wave costs more than shorter splits save: H200, 16 groups x 2000 tokens, 128
    programs a split, 2 splits 54.0 against 3 splits 65.3 us), none shorter than
    min_keys_per_split keys (each split costs a partial write and read per query row)."""
    programs = max(num_groups * num_tiles_per_group * num_kv_heads, 1)
    want = max(1, 2 * num_sms // programs)
    cap = max(max_prefix_len // min_keys_per_split, 1)
    return max(1, min(want, cap, max_splits))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _H200_NUM_SMS


def _check_inputs(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, prefix_lens,
                  cu_group_seqs, out):
    check_q_and_caches(q, k_cache, v_cache)
    ints = (("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens),
            ("prefix_lens", prefix_lens), ("cu_group_seqs", cu_group_seqs))
    for name, t in ints:
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    num_seqs = seq_lens.shape[0]
    if seq_lens.dim() != 1 or num_seqs >= _MAX_GRID_YZ:
        raise ValueError(f"seq_lens must be [B] with B <= {_MAX_GRID_YZ - 1} (a CUDA grid dimension), "
                         f"got {tuple(seq_lens.shape)}")
    if (block_table.dim() != 2 or block_table.shape[0] != num_seqs or cu_seqlens_q.shape != (num_seqs + 1,)
            or prefix_lens.shape != (num_seqs,)):
        raise ValueError(
            f"with {num_seqs} sequences, block_table must be [{num_seqs}, max_blocks], cu_seqlens_q "
            f"[{num_seqs + 1}] and prefix_lens [{num_seqs}], got {tuple(block_table.shape)}, "
            f"{tuple(cu_seqlens_q.shape)} and {tuple(prefix_lens.shape)}")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table must have unit stride along blocks, got strides {block_table.stride()}")
    if cu_group_seqs.dim() != 1 or not 1 <= cu_group_seqs.shape[0] <= _MAX_GRID_YZ:
        raise ValueError(f"cu_group_seqs must be [max_groups + 1] with 0 <= max_groups <= "
                         f"{_MAX_GRID_YZ - 1}, got {tuple(cu_group_seqs.shape)}")
    device = q.device
    if device.type != "cuda" and not (_INTERPRETED and device.type == "cpu"):
        raise ValueError(f"q is on {device}: cascade_attention needs CUDA tensors (CPU only with "
                         "TRITON_INTERPRET=1 set before kernels.cascade_attention is imported)")
    tensors = (k_cache, v_cache) + tuple(t for _, t in ints) + ((out,) if out is not None else ())
    if any(t.device != device for t in tensors):
        raise ValueError("all tensors must be on q's device")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")


def cascade_attention(
    q: torch.Tensor,             # [T, Hq, D], any strides
    k_cache: torch.Tensor,       # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,   # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,      # [B] int32
    prefix_lens: torch.Tensor,   # [B] int32
    cu_group_seqs: torch.Tensor,  # [max_groups + 1] int32
    scale: float,
    *,
    max_seqlen_q: int,
    max_group_rows: int,
    max_prefix_len: int,
    num_prefix_splits: int | None = None,
    out: torch.Tensor | None = None,
    own_decode_seqs: torch.Tensor | None = None,
    own_prompt_seqs: torch.Tensor | None = None,
    prompt_prefixes: bool = True,
    side_by_side: bool = False,
) -> torch.Tensor:
    """Causal paged attention with shared prefixes read once per group, as `cascade_attention_ref`.
    Returns [T, Hq, D].

    own_decode_seqs, own_prompt_seqs (both or neither; int32 [n] each): the own pass apart for
    the sequences of one query row (decode tiles) and those of more (prompt tiles), as plain paged
    attention does a mixed step (engine/models/attention.py): in one launch a decode row takes a
    prompt tile 32 positions tall. The caller lists every sequence with rows in one of them, by
    its q_len (unchecked, as max_seqlen_q). prompt_prefixes=False (with them): the prompt
    launch is compiled for a prefix of literal 0 with no fold of prefix partials, as fast as the
    plain kernel's prompt tiles. For sequences with no prefix that is exact; one with a prefix
    would read its prefix's keys there too (the values still right, its prefix partials unused
    and wasted), so the engine passes False only where no prompt row has a prefix (its prompt
    chunks longer than a prefix tile are never group members: engine/cascade_plan.py, step 1).

    Host ints, none checked on the device (that would sync): max_seqlen_q >= every q_len;
    max_group_rows >= the query rows of every group with a prefix (it sizes the prefix grid);
    max_prefix_len >= every prefix_len (it only sizes the default split count). For a CUDA graph
    pass all three and num_prefix_splits at their capture-time capacities.
    num_prefix_splits=None: `choose_num_prefix_splits` for max_groups groups. out: optional
    [T, Hq, D] buffer (any strides) to write into.
    side_by_side (a step without own_decode_seqs): the prefix pass runs on a side stream beside
    the own pass, which leaves each prefixed row's partial for `_merge_kernel` (same bits; on
    the CPU interpreter the same three launches in turn). A decode step's prefix pass is a few
    programs a group over long prefixes, the own pass many short ones over few keys: side by
    side each fills what the other leaves of the SMs and of HBM.
    """
    _check_inputs(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, prefix_lens,
                  cu_group_seqs, out)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_group_rows", max_group_rows)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if max_prefix_len < 0:
        raise ValueError(f"max_prefix_len must be >= 0, got {max_prefix_len}")
    if (own_decode_seqs is None) != (own_prompt_seqs is None):
        raise ValueError("own_decode_seqs and own_prompt_seqs come together (or neither)")
    for name, ids in (("own_decode_seqs", own_decode_seqs), ("own_prompt_seqs", own_prompt_seqs)):
        if ids is not None and (ids.dim() != 1 or ids.shape[0] < 1 or ids.dtype != torch.int32
                                or ids.device != q.device):
            raise ValueError(f"{name} must be a non-empty int32 [n] tensor on {q.device}, got "
                             f"{ids.dtype} {tuple(ids.shape)} on {ids.device}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    g_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    prefix_cfg = _prefix_config(max_group_rows, g_pad, head_dim, q.dtype)
    own_cfg = _own_config(max_seqlen_q, head_dim, q.dtype)
    num_groups = cu_group_seqs.shape[0] - 1
    num_tiles = triton.cdiv(max_group_rows, _tile_rows(num_heads, num_kv_heads, prefix_cfg)[2])
    if num_prefix_splits is None:
        num_prefix_splits = choose_num_prefix_splits(num_groups, num_tiles, num_kv_heads,
                                                     max_prefix_len, _num_sms(q.device))
    if num_prefix_splits < 1 or num_kv_heads * num_prefix_splits > _MAX_GRID_YZ:
        raise ValueError(f"num_prefix_splits must be in 1..{_MAX_GRID_YZ // num_kv_heads} or None, "
                         f"got {num_prefix_splits}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    side_by_side = side_by_side and num_groups > 0 and own_decode_seqs is None
    # fp32 partials of every (split, row, head), and the own pass's after them when side by
    # side; torch.empty is graph-safe (private pool).
    slots = num_prefix_splits + int(side_by_side)
    part_m = torch.empty(slots, num_tokens, num_heads, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(slots, num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    args = (q, k_cache, v_cache, block_table, cu_seqlens_q.contiguous(), seq_lens.contiguous(),
            prefix_lens.contiguous(), cu_group_seqs.contiguous(), out, part_m, part_l, part_acc, scale)
    if side_by_side:
        with side_stream(q.device) as on_side:
            with on_side:
                _launch_prefix(*args, max_group_rows, num_prefix_splits, prefix_cfg)
            _launch_own(*args, max_seqlen_q, num_prefix_splits, own_cfg, own_partial=True)
        _launch_merge(*args, max_seqlen_q, num_prefix_splits, own_cfg)
        return out
    if num_groups > 0:
        _launch_prefix(*args, max_group_rows, num_prefix_splits, prefix_cfg)
    if own_decode_seqs is None:
        _launch_own(*args, max_seqlen_q, num_prefix_splits, own_cfg)
    else:   # one query row each, in decode tiles; then the prompt rows (and the padding rows)
        _launch_own(*args, 1, num_prefix_splits, _own_config(1, head_dim, q.dtype), own_decode_seqs, False)
        _launch_own(*args, max_seqlen_q, num_prefix_splits, own_cfg, own_prompt_seqs, True,
                    has_prefix=prompt_prefixes)
    return out


def _loop_form(cfg: _TileConfig, k_cache: torch.Tensor, v_cache: torch.Tensor, *, prompt: bool,
               i32: bool) -> dict:
    """The key loop's PROMPT and I32 constexprs for a launch: the config's where it names them,
    else the pass's rule (`prompt`, `i32`); int32 offsets only where the caches allow them."""
    use_i32 = i32 if cfg.i32 is None else cfg.i32
    return {"PROMPT": prompt if cfg.prompt is None else cfg.prompt,
            "I32": use_i32 and _int32_offsets(k_cache, v_cache)}


def _tile_rows(num_heads: int, num_kv_heads: int, cfg: _TileConfig) -> tuple[int, int, int]:
    """(query heads a kv head, that padded to a power of two, query positions a tile) of a
    launch: a tile's cfg.block_q rows are positions x padded heads."""
    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    return group, g_pad, max(cfg.block_q // g_pad, 1)


def _launch_prefix(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, prefix_lens,
                   cu_group_seqs, out, part_m, part_l, part_acc, scale,
                   max_group_rows, num_splits, cfg: _TileConfig) -> None:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group, g_pad, block_m = _tile_rows(num_heads, num_kv_heads, cfg)
    grid = (triton.cdiv(max_group_rows, block_m), cu_group_seqs.shape[0] - 1, num_kv_heads * num_splits)
    _prefix_kernel[grid](
        q, k_cache, v_cache, part_m, part_l, part_acc,
        block_table, cu_seqlens_q, prefix_lens, cu_group_seqs,
        scale * _LOG2E, num_tokens, num_heads,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0),
        GROUP=group, G_PAD=g_pad, BLOCK_M=block_m, BLOCK_Q=block_m * g_pad,
        BLOCK_N=cfg.block_n, HEAD_DIM=head_dim, PAGE_SIZE=block_size, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **_loop_form(cfg, k_cache, v_cache, prompt=False, i32=False),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _launch_merge(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, prefix_lens,
                  cu_group_seqs, out, part_m, part_l, part_acc, scale,
                  max_seqlen_q, num_splits, cfg: _TileConfig) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group, g_pad, block_m = _tile_rows(num_heads, num_kv_heads, cfg)
    num_m_tiles = triton.cdiv(max_seqlen_q, block_m)
    _merge_kernel[(num_m_tiles, seq_lens.shape[0], num_kv_heads)](
        out, part_m, part_l, part_acc, cu_seqlens_q, prefix_lens, num_tokens, num_heads, num_m_tiles,
        *out.stride(), GROUP=group, G_PAD=g_pad, BLOCK_M=block_m, BLOCK_Q=block_m * g_pad,
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits, num_warps=4,
    )


def _launch_own(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, prefix_lens,
                cu_group_seqs, out, part_m, part_l, part_acc, scale,
                max_seqlen_q, num_splits, cfg: _TileConfig, seq_ids: torch.Tensor | None = None,
                pad: bool = True, own_partial: bool = False, has_prefix: bool = True) -> None:
    """The own pass over every sequence, or over those in seq_ids; pad: one more program that
    zeroes the rows past cu_seqlens_q[-1]; own_partial: rows with a prefix leave their partial
    for `_merge_kernel` (slot num_splits of the workspace); has_prefix=False: none of them has a
    prefix (the kernel compiled for prefix 0)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    group, g_pad, block_m = _tile_rows(num_heads, num_kv_heads, cfg)
    num_m_tiles = triton.cdiv(max_seqlen_q, block_m)
    num_listed = num_seqs if seq_ids is None else seq_ids.shape[0]
    _own_kernel[(num_m_tiles, num_listed + int(pad), num_kv_heads)](
        q, k_cache, v_cache, out, part_m, part_l, part_acc,
        block_table, cu_seqlens_q, seq_lens, prefix_lens, cu_seqlens_q if seq_ids is None else seq_ids,
        scale * _LOG2E, num_seqs, num_tokens, num_heads, num_m_tiles, num_listed,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), block_table.stride(0),
        GROUP=group, G_PAD=g_pad, BLOCK_M=block_m, BLOCK_Q=block_m * g_pad,
        BLOCK_N=cfg.block_n, HEAD_DIM=head_dim, PAGE_SIZE=block_size, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **_loop_form(cfg, k_cache, v_cache, prompt=_prompt_loop(max_seqlen_q, k_cache), i32=True),
        HAS_SEQ_IDS=seq_ids is not None, OWN_PARTIAL=own_partial, HAS_PREFIX=has_prefix,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
