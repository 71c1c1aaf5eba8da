"""Paged attention in Triton: one kernel for prefill chunks, decode rows and mixed batches.

Same contract and layouts as `attention_ref.paged_attention_ref` (re-exported here for tests):

  q                [T, Hq, D]     new tokens of the B sequences back to back; any strides
  k_cache, v_cache [num_blocks, block_size, Hkv, D]   any strides; q's dtype, or both FP8 (e4m3,
                                  EngineConfig.kv_cache_dtype): widened as read, see _q_for_keys
  block_table      [B, max_blocks] int32, block ids of each sequence in position order
  cu_seqlens_q     [B + 1] int32  sequence b owns q rows cu_seqlens_q[b]:cu_seqlens_q[b + 1]
  seq_lens         [B] int32      context length of b including its new tokens
  out              [T, Hq, D]     q's dtype; rows past cu_seqlens_q[-1] are written as zeros, rows
                                  before cu_seqlens_q[0] (another call's) are left as they are

Query row i of sequence b (q_len rows, L = seq_lens[b]) sits at position p = L - q_len + i and
query head h reads kv head h // G, G = Hq // Hkv. With scores in fp32,

    out[p, h] = sum_j softmax_j(scale * q[p, h] . k[j, h // G]) v[j, h // G]
    over key positions j <= p and, given a sliding window W, j > p - W,

computed with an online softmax (running max m, running sum l, fp32 accumulator; exp2 with
log2(e) folded into the scale).

Tiling. One program owns a tile of BLOCK_M query positions x all G query heads of one kv head
(BLOCK_Q = BLOCK_M * G_PAD rows, row r = position r // G_PAD, head r % G_PAD), so each K/V block
read from the cache serves every query head that shares it, and tl.dot sees >= 16 rows even for
one decode token. The program walks its sequence's keys BLOCK_N at a time through the block
table; key blocks that no row of the tile can see (after the last position, before the first
window) are never visited, and those every row sees skip the mask math (only the window's ragged
start and the causal diagonal are masked). Grid: (query tiles of the longest q, B + 1, Hkv * num_kv_splits);
the extra "sequence" B zeroes the padding rows past cu_seqlens_q[-1]. The tail programs of the
longest prompts start first. An unsplit decode call over an FP8 cache walks its keys on one warp
in `_attend_keys_parts`' loop (a step's keys may be cut into parts, a warp each, merged after).

Split-KV. With num_kv_splits = S > 1 each tile's key range is cut into S pieces (whole BLOCK_N
steps), each program writes its partial (m, l, acc) to an fp32 workspace, and the partials are
merged (log-sum-exp, fp32, split by split in order: `_merge_splits`):

    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,   M = max_s m_s

either by `_reduce_splits_kernel`, a second launch (`choose_num_kv_splits` picks S for decode
calls: a few long sequences, 8k-32k keys, fill the SMs), or with merge_in_kernel=True inside the
same launch: after storing its partial, each program bumps its (sequence, query tile, kv head)
arrival counter (kernels/arrival_counters.py, acq_rel atomic, after a barrier so the whole
program's stores come first); the program that arrives last merges the S partials with the same
`_merge_splits` (so the same bits as the two launches, whichever program is last), writes the
output and sets the counter back to 0. Without the second launch a split is worth it at short
contexts too: `choose_fused_kv_splits` picks S so that small decode batches fill the SMs (a
decode program streams its keys at what one SM pulls), over 64-key steps.

CUDA graphs. The launcher reads no device value: grids come from tensor shapes and the ints
max_seqlen_q / num_kv_splits; shorter sequences exit early or mask. The caller must pass
max_seqlen_q >= every q_len (unchecked, as checking would sync). The split workspace is a
torch.empty per call; under graph capture it comes from the graph's private memory pool. The
arrival counters are allocated on the first merge_in_kernel call, which must come before capture;
calls on one device must not overlap in time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.arrival_counters import arrival_counters
from kernels.attention_ref import FP8_KV_DTYPES, paged_attention_ref
from kernels.pdl import check as check_pdl, launch_options

__all__ = ["paged_attention", "paged_attention_ref", "choose_num_kv_splits", "choose_fused_kv_splits"]

_LOG2E = 1.4426950408889634
_HEAD_DIMS = (16, 32, 64, 128, 256)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_H200_NUM_SMS = 132
_MAX_GRID_Y = 65535             # grid axis 1 holds B + 1 programs
_FUSED_DECODE_BLOCK_N = 64      # keys per step of a decode split merged in the kernel


# The kernels call Triton builtins only, none of triton's own @triton.jit library functions
# (tl.max, tl.sum, tl.zeros, tl.cdiv): those are decorated when triton is first imported, so with
# TRITON_INTERPRET set later (the CPU tests) they would not run. Reductions go through tl.reduce
# with triton's own combine functions, which the interpreter maps to numpy (any other combine
# function runs there element by element) and which compile to what tl.max / tl.sum give.
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine


@triton.jit
def _attend_keys(
    acc, m_i, l_i, q, q_pos, table_row, k_base, v_base, k_start, k_stop, qk_scale, sliding_window,
    stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_AHEAD: tl.constexpr, CAUSAL: tl.constexpr,
    PROMPT: tl.constexpr, I32: tl.constexpr,
):
    """Online-softmax update of (acc, m_i, l_i) over keys [k_start, k_stop), BLOCK_N at a time
    from a multiple of BLOCK_N. MASKED=False: every key is visible to every row (no mask math);
    MASKED=True: keys >= k_stop are dropped and, with CAUSAL, keys after a row's position q_pos
    (kernels/cascade_attention.py's prefix pass: no CAUSAL, every row sees the whole prefix).
    KV_AHEAD (decode): the K and V tiles of step i + 1 are loaded before step i's math, so a
    program waits for memory once, not once a step (its loads go through the block table, which
    the compiler's own pipelining does not look ahead through). PROMPT (prompt tiles): the block
    ids of step i + 1 are read during step i, so the addresses of a step's K and V wait for no
    load of that step and the compiler's pipelining issues them ahead, and K is read key by key
    in V's layout (one layout for both tiles' addresses; its transpose goes to the dot). H100,
    prompt tiles: 1.14-1.26x the speed of reading each step's ids in it; in decode tiles both
    were 2-6% slower (benchmarks/h100/prefill_attention.md); decode tiles over an FP8 cache take
    it too (`_prompt_loop`). I32: the K/V element offsets (from a kv head's base) are computed in
    int32 (`_int32_offsets`: where the caches' size allows; H100 prompt tiles another
    1.05-1.15x, H200 decode 3%)."""
    offs_n = tl.arange(0, BLOCK_N)
    if KV_AHEAD:
        k, v = _kv_tiles(table_row, k_base, v_base, k_start, k_stop, stride_kb, stride_ks, stride_kd,
                         stride_vb, stride_vs, stride_vd, BLOCK_N, HEAD_DIM, PAGE_SIZE, True, I32)
        for start in range(k_start, k_stop, BLOCK_N):
            k_next, v_next = _kv_tiles(table_row, k_base, v_base, start + BLOCK_N, k_stop, stride_kb, stride_ks,
                                       stride_kd, stride_vb, stride_vs, stride_vd, BLOCK_N, HEAD_DIM, PAGE_SIZE,
                                       True, I32)
            acc, m_i, l_i = _online_step(acc, m_i, l_i, q, k, v, q_pos, start + offs_n, k_stop, qk_scale,
                                         sliding_window, MASKED, CAUSAL, HAS_WINDOW, DOT_PRECISION, False)
            k, v = k_next, v_next
    elif PROMPT:
        block_id = _block_ids(table_row, k_start, k_stop, BLOCK_N, PAGE_SIZE, True, I32)
        for start in range(k_start, k_stop, BLOCK_N):
            next_block_id = _block_ids(table_row, start + BLOCK_N, k_stop, BLOCK_N, PAGE_SIZE, True, I32)
            k, v = _kv_at(block_id, k_base, v_base, start, k_stop, stride_kb, stride_ks, stride_kd,
                          stride_vb, stride_vs, stride_vd, BLOCK_N, HEAD_DIM, PAGE_SIZE, MASKED, True, I32)
            block_id = next_block_id
            acc, m_i, l_i = _online_step(acc, m_i, l_i, q, k, v, q_pos, start + offs_n, k_stop, qk_scale,
                                         sliding_window, MASKED, CAUSAL, HAS_WINDOW, DOT_PRECISION, True)
    else:
        for start in range(k_start, k_stop, BLOCK_N):
            k, v = _kv_tiles(table_row, k_base, v_base, start, k_stop, stride_kb, stride_ks, stride_kd,
                             stride_vb, stride_vs, stride_vd, BLOCK_N, HEAD_DIM, PAGE_SIZE, MASKED, I32)
            acc, m_i, l_i = _online_step(acc, m_i, l_i, q, k, v, q_pos, start + offs_n, k_stop, qk_scale,
                                         sliding_window, MASKED, CAUSAL, HAS_WINDOW, DOT_PRECISION, False)
    return acc, m_i, l_i


@triton.jit
def _kv_tiles(table_row, k_base, v_base, start, k_stop, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs,
              stride_vd, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
              MASKED: tl.constexpr, I32: tl.constexpr):
    """k [D, BLOCK_N] and v [BLOCK_N, D] of keys start.. (zeros from k_stop on when MASKED),
    gathered key by key through the block table."""
    return _kv_at(_block_ids(table_row, start, k_stop, BLOCK_N, PAGE_SIZE, MASKED, I32), k_base, v_base, start,
                  k_stop, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, BLOCK_N, HEAD_DIM,
                  PAGE_SIZE, MASKED, False, I32)


@triton.jit
def _block_ids(table_row, start, k_stop, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
               I32: tl.constexpr):
    """[BLOCK_N] block ids of keys start.. (MASKED: 0 from k_stop on, nothing read there), int32
    with I32, else int64."""
    k_pos = start + tl.arange(0, BLOCK_N)
    if MASKED:
        ids = tl.load(table_row + k_pos // PAGE_SIZE, mask=k_pos < k_stop, other=0)
    else:
        ids = tl.load(table_row + k_pos // PAGE_SIZE)
    if not I32:
        ids = ids.to(tl.int64)
    return ids


@triton.jit
def _kv_at(block_id, k_base, v_base, start, k_stop, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs,
           stride_vd, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
           MASKED: tl.constexpr, K_BY_KEY: tl.constexpr, I32: tl.constexpr):
    """v [BLOCK_N, D] and k of keys start.. in blocks block_id (zeros from k_stop on when MASKED):
    k [BLOCK_N, D] with K_BY_KEY, else [D, BLOCK_N]. I32: offsets in int32 (block_id is int32)."""
    k_pos = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    slot = k_pos % PAGE_SIZE
    if I32:
        slot = slot.to(tl.int32)
    k_in = k_pos < k_stop
    if K_BY_KEY:
        k_ptrs = k_base + block_id[:, None] * stride_kb + slot[:, None] * stride_ks + offs_d[None, :] * stride_kd
        k_mask = k_in[:, None]
    else:
        k_ptrs = k_base + block_id[None, :] * stride_kb + slot[None, :] * stride_ks + offs_d[:, None] * stride_kd
        k_mask = k_in[None, :]
    v_ptrs = v_base + block_id[:, None] * stride_vb + slot[:, None] * stride_vs + offs_d[None, :] * stride_vd
    if MASKED:
        k = tl.load(k_ptrs, mask=k_mask, other=0.0)
        v = tl.load(v_ptrs, mask=k_in[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return k, v


@triton.jit
def _online_step(acc, m_i, l_i, q, k, v, q_pos, k_pos, k_stop, qk_scale, sliding_window,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, K_BY_KEY: tl.constexpr):
    """One BLOCK_N step of the online softmax over the keys at k_pos. MASKED: keys from k_stop
    on are dropped and, with CAUSAL, keys after a row's position q_pos, with HAS_WINDOW those
    before its window (kernels/cascade_attention.py runs it too). k: [BLOCK_N, D] with K_BY_KEY,
    else [D, BLOCK_N]."""
    k = k.to(q.dtype)       # an FP8 cache's keys and values widen to q's dtype (exact, see
    v = v.to(q.dtype)       # _q_for_keys); else no-op
    if K_BY_KEY:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale     # [BLOCK_Q, BLOCK_N]
    else:
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        visible = (k_pos < k_stop)[None, :]
        if CAUSAL:
            visible = visible & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        # A row that has seen no visible key yet keeps m = -inf: subtract 0, not inf - inf.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        m_sub = m_new
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(s - m_sub[:, None])
    l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_keys_parts(
    acc, m_i, l_i, q, table_row, k_base, v_base, k_start, k_stop, qk_scale,
    stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, I32: tl.constexpr, PARTS: tl.constexpr,
):
    """_attend_keys for an unsplit decode call's one loop, masked on k_stop alone: its one query
    sits at k_stop - 1, so no key before k_stop is causally hidden (ONE_LOOP), and with a window
    none from k_start on is outside it (the kernel reads the window's ragged start before, up to
    the first step whose keys are all inside). Each step's BLOCK_N keys are cut into PARTS runs
    of BLOCK_N // PARTS, each its own online softmax through batched (3-D) dots, which triton's
    mma layout gives a warp each: inside the loop no warp waits for another's row maxima or sums
    or exchanges p with it (a 2-D tile's dots split the keys and the head dim across warps, and
    each step's softmax and p cross them). The parts merge with (acc, m_i, l_i) once, after the
    loop (log-sum-exp, fp32). Block ids a step ahead and K key by key, as the PROMPT loop.
    One part on one warp is the FP8 cache's unsplit decode (_pick_config: 17-23% faster than the
    2-D tile on 4 warps, and at 512 rows than the 2-D loop on one warp)."""
    PART_N: tl.constexpr = BLOCK_N // PARTS
    key = tl.arange(0, PARTS)[:, None] * PART_N + tl.arange(0, PART_N)[None, :]      # [P, PN] of a step
    qp = tl.broadcast_to(q[None, :, :], (PARTS, q.shape[0], HEAD_DIM))
    m_p = tl.full([PARTS, q.shape[0]], float("-inf"), dtype=tl.float32)
    l_p = tl.full([PARTS, q.shape[0]], 0.0, dtype=tl.float32)
    acc_p = tl.full([PARTS, q.shape[0], HEAD_DIM], 0.0, dtype=tl.float32)
    offs_d = tl.arange(0, HEAD_DIM)
    block_id = _part_block_ids(table_row, k_start + key, k_stop, PAGE_SIZE, I32)
    for start in range(k_start, k_stop, BLOCK_N):
        k_pos = start + key
        next_block_id = _part_block_ids(table_row, k_pos + BLOCK_N, k_stop, PAGE_SIZE, I32)
        slot = k_pos % PAGE_SIZE
        if I32:
            slot = slot.to(tl.int32)
        k_in = k_pos < k_stop
        k_ptrs = k_base + (block_id * stride_kb + slot * stride_ks)[:, :, None] + offs_d[None, None, :] * stride_kd
        v_ptrs = v_base + (block_id * stride_vb + slot * stride_vs)[:, :, None] + offs_d[None, None, :] * stride_vd
        k = tl.load(k_ptrs, mask=k_in[:, :, None], other=0.0).to(q.dtype)      # [P, PN, D]; an FP8 cache widens
        v = tl.load(v_ptrs, mask=k_in[:, :, None], other=0.0).to(q.dtype)
        block_id = next_block_id
        s = tl.dot(qp, tl.trans(k, (0, 2, 1)), input_precision=DOT_PRECISION) * qk_scale     # [P, rows, PN]
        s = tl.where(k_in[:, None, :], s, float("-inf"))
        m_new = tl.maximum(m_p, tl.reduce(s, 2, _MAX))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)     # a part that has seen no key yet
        alpha = tl.exp2(m_p - m_sub)
        p = tl.exp2(s - m_sub[:, :, None])
        l_p = l_p * alpha + tl.reduce(p, 2, _SUM)
        acc_p = acc_p * alpha[:, :, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_p = m_new
    m_new = tl.maximum(m_i, tl.reduce(m_p, 0, _MAX))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    w = tl.exp2(m_p - m_sub[None, :])
    alpha = tl.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.reduce(l_p * w, 0, _SUM)
    acc = acc * alpha[:, None] + tl.reduce(acc_p * w[:, :, None], 0, _SUM)
    return acc, m_new, l_i


@triton.jit
def _part_block_ids(table_row, k_pos, k_stop, PAGE_SIZE: tl.constexpr, I32: tl.constexpr):
    """Block ids of the keys at k_pos (any shape; 0 from k_stop on, nothing read there)."""
    ids = tl.load(table_row + k_pos // PAGE_SIZE, mask=k_pos < k_stop, other=0)
    if not I32:
        ids = ids.to(tl.int64)
    return ids


@triton.jit
def _q_for_keys(q, k_cache_ptr):
    """q as the key loop's dots take it. Over an FP8 (e4m3) cache a bf16 q goes to fp16 (clamped
    to +-65504; exact within that range but for values under 2^-14, fp16's subnormals), so the
    cache's values widen to fp16 and the dots (p too) run in fp16: e4m3 -> fp16 is one cvt a
    pair of values, where e4m3 -> bf16 took several (H200, 256 decode rows at 1620 keys: the
    bf16 form ran 451 us a call, slower than the bf16 cache's 423 us; benchmarks/h200/
    fp8_kv_cache.md). Otherwise q as it is."""
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:     # (nested, one return: both static for Triton)
        if q.dtype == tl.bfloat16:
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


@triton.jit
def _merge_splits(part_m_ptr, part_l_ptr, part_acc_ptr, part0, valid,
                  ROWS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The merged fp32 output [ROWS, D] of the NUM_SPLITS partials of ROWS (token, head) rows whose
    split 0 sits at part0 [ROWS]: sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s,
    added split by split in order (both merges run this: the same bits). Rows not valid read
    nothing and come back 0. The loads skip L1 (.cg): in the fused kernel other SMs wrote them."""
    offs_d = tl.arange(0, HEAD_DIM)
    m_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):   # unrolled: the loads need not wait for each other
        m_s = tl.load(part_m_ptr + part0 + s, mask=valid, other=float("-inf"), cache_modifier=".cg")
        m_max = tl.maximum(m_max, m_s)
    m_max = tl.where(valid, m_max, 0.0)     # finite on valid rows: a split saw the row's own key
    l_sum = tl.full([ROWS], 0.0, dtype=tl.float32)
    acc = tl.full([ROWS, HEAD_DIM], 0.0, dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m_s = tl.load(part_m_ptr + part0 + s, mask=valid, other=float("-inf"), cache_modifier=".cg")
        w = tl.exp2(m_s - m_max)            # 0 for a split that saw no key of the row
        l_sum += w * tl.load(part_l_ptr + part0 + s, mask=valid, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(part_acc_ptr + (part0 + s)[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=valid[:, None], other=0.0, cache_modifier=".cg")
        acc += w[:, None] * acc_s
    return acc / tl.where(valid, l_sum, 1.0)[:, None]


# Integer arguments that change from step to step are not specialized on (Triton compiles a
# variant per value class: == 1, divisible by 16, other): otherwise a new mix of batch sizes
# could compile a kernel in the middle of serving (seconds), long after start-up.
_VARYING = ["num_seqs", "num_tokens", "num_m_tiles", "stride_bt"]


@triton.jit(do_not_specialize=_VARYING)
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,              # [T, Hq, S] x2, [T, Hq, S, D] fp32
    count_ptr,                                         # [B * m tiles * Hkv] int32, zero
    block_table_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
    qk_scale, sliding_window, num_seqs, num_tokens, num_heads, num_m_tiles,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, KV_AHEAD: tl.constexpr, PROMPT: tl.constexpr,
    I32: tl.constexpr, ONE_LOOP: tl.constexpr, PARTS: tl.constexpr,
):
    if USE_PDL:     # kernels/pdl.py: the kernel ahead is done before anything is read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Longest-running tiles (last positions of a prompt see the most keys) start first.
    pid_m = num_m_tiles - 1 - tl.program_id(0).to(tl.int64)
    seq = tl.program_id(1).to(tl.int64)
    pid_hs = tl.program_id(2).to(tl.int64)
    kv_head = pid_hs // NUM_SPLITS
    split = pid_hs % NUM_SPLITS

    rows = tl.arange(0, BLOCK_Q)
    row_pos = rows // G_PAD                     # query position inside the tile
    row_g = rows % G_PAD                        # query head inside the group
    head = kv_head * GROUP + row_g
    offs_d = tl.arange(0, HEAD_DIM)

    if seq == num_seqs:
        # Padding rows past cu_seqlens_q[-1] come back zero, as in the reference.
        if split == 0:
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

    first_pos = seq_len - q_len + pid_m * BLOCK_M   # position of the tile's first query
    row_in_seq = pid_m * BLOCK_M + row_pos
    row_valid = (row_g < GROUP) & (row_in_seq < q_len)
    q_pos = first_pos + row_pos

    # Keys [k_lo, k_hi) are all a tile can see: up to its last query, from its first's window.
    k_hi = tl.minimum(first_pos + BLOCK_M, seq_len)
    k_lo = 0
    if HAS_WINDOW:
        k_lo = tl.maximum(first_pos - sliding_window + 1, 0)
    k_lo = (k_lo // BLOCK_N) * BLOCK_N
    if NUM_SPLITS > 1:
        per_split = ((k_hi - k_lo + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        k_lo = k_lo + split * per_split
        k_hi = tl.maximum(tl.minimum(k_lo + per_split, k_hi), k_lo)    # may be empty
    # Keys [k_full_lo, k_full_hi) are visible to every valid row of the tile: no mask there.
    k_full_hi = tl.maximum(tl.minimum((first_pos + 1) // BLOCK_N * BLOCK_N, k_hi), k_lo)
    k_full_lo = k_lo
    if HAS_WINDOW:
        last_pos = tl.minimum(first_pos + BLOCK_M, seq_len) - 1
        # (// truncates toward zero on the GPU: keep its operands >= 0)
        window_lo = tl.maximum(last_pos - sliding_window + BLOCK_N, 0) // BLOCK_N * BLOCK_N
        k_full_lo = tl.minimum(tl.maximum(window_lo, k_lo), k_hi)
        k_full_hi = tl.maximum(k_full_hi, k_full_lo)

    t = q_start + row_in_seq
    q_ptrs = q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = _q_for_keys(tl.load(q_ptrs, mask=row_valid[:, None], other=0.0), k_cache_ptr)

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_Q], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_Q, HEAD_DIM], 0.0, dtype=tl.float32)
    table_row = block_table_ptr + seq * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    if HAS_WINDOW:          # the window's ragged start
        acc, m_i, l_i = _attend_keys(
            acc, m_i, l_i, q, q_pos, table_row, k_base, v_base, k_lo, k_full_lo, qk_scale, sliding_window,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
            BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, MASKED=True, HAS_WINDOW=HAS_WINDOW,
            DOT_PRECISION=DOT_PRECISION, KV_AHEAD=KV_AHEAD, CAUSAL=True, PROMPT=PROMPT, I32=I32)
    if ONE_LOOP:    # unsplit decode (`_one_loop`): one pipelined loop, the last block's mask on every step
        k_full_hi = k_full_lo
    else:
        acc, m_i, l_i = _attend_keys(
            acc, m_i, l_i, q, q_pos, table_row, k_base, v_base, k_full_lo, k_full_hi, qk_scale, sliding_window,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
            BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, MASKED=False, HAS_WINDOW=HAS_WINDOW,
            DOT_PRECISION=DOT_PRECISION, KV_AHEAD=KV_AHEAD, CAUSAL=True, PROMPT=PROMPT, I32=I32)
    # Causal masking is needed but for ONE_LOOP: there each sequence's one query sits at seq_len - 1,
    # so the keys below k_hi (= seq_len) are the keys it may see, and the mask on k_hi alone is the
    # same set (rows past q_len are not stored). The mask's per-step work left the FP8 form at 255
    # registers with a spill; without it 212 and none, and the FP8 decode took 7-10% less time
    # (H200, 256 x 1,620 keys 314.8 -> 284.0 us; bf16 unchanged; benchmarks/h200/fp8_decode.md).
    if PARTS > 0:   # ONE_LOOP's keys in parts, a warp each (_attend_keys_parts)
        acc, m_i, l_i = _attend_keys_parts(
            acc, m_i, l_i, q, table_row, k_base, v_base, k_full_hi, k_hi, qk_scale,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
            BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, DOT_PRECISION=DOT_PRECISION, I32=I32,
            PARTS=PARTS)
    else:
        acc, m_i, l_i = _attend_keys(     # the causal diagonal and the sequence's last partial block
            acc, m_i, l_i, q, q_pos, table_row, k_base, v_base, k_full_hi, k_hi, qk_scale, sliding_window,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
            BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, MASKED=True, HAS_WINDOW=HAS_WINDOW,
            DOT_PRECISION=DOT_PRECISION, KV_AHEAD=KV_AHEAD, CAUSAL=not ONE_LOOP, PROMPT=PROMPT, I32=I32)

    out_ptrs = out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        # A split that sees no key of a row stores m = -inf, l = 0, acc = 0 for it.
        part0 = (t * num_heads + head) * NUM_SPLITS
        part = part0 + split
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_valid[:, None])
        if MERGE_IN_KERNEL:
            tl.debug_barrier()  # every thread's partial is stored before the release below
            counter = count_ptr + (seq * num_m_tiles + pid_m) * (num_heads // GROUP) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == NUM_SPLITS - 1:           # the others' partials are all stored
                out = _merge_splits(part_m_ptr, part_l_ptr, part_acc_ptr, part0, row_valid,
                                    BLOCK_Q, NUM_SPLITS, HEAD_DIM)
                tl.atomic_xchg(counter, 0)
                tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_seqs"])
def _reduce_splits_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, cu_seqlens_q_ptr,
    num_seqs, num_heads, stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, ROWS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """`_merge_splits` for ROWS token rows x the G query heads of one kv head (row r = token
    r // G_PAD, head r % G_PAD)."""
    pid_t = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    offs_r = tl.arange(0, ROWS * G_PAD)
    t = pid_t * ROWS + offs_r // G_PAD
    g = offs_r % G_PAD
    offs_d = tl.arange(0, HEAD_DIM)
    # Padding rows past cu_seqlens_q[-1] were zeroed by the main kernel and have no partials;
    # rows before cu_seqlens_q[0] belong to another call (a mixed step's prompt-chunk call reads
    # its rows of q in place, after the decode rows: engine/models/attention.py).
    valid = ((g < GROUP) & (t >= tl.load(cu_seqlens_q_ptr))
             & (t < tl.load(cu_seqlens_q_ptr + num_seqs)))
    head = kv_head * GROUP + g
    out = _merge_splits(part_m_ptr, part_l_ptr, part_acc_ptr, (t * num_heads + head) * NUM_SPLITS,
                        valid, ROWS * G_PAD, NUM_SPLITS, HEAD_DIM)
    tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=valid[:, None])


@dataclass(frozen=True)
class _TileConfig:
    block_q: int        # target rows per tile (query positions x padded group)
    block_n: int        # keys per step
    num_warps: int
    num_stages: int
    parts: int = 0      # unsplit decode: a step's keys in this many parts (_attend_keys_parts); 0: the 2-D loops


def _pick_config(max_seqlen_q: int, head_dim: int, dtype: torch.dtype,
                 fused_splits: bool = False, fp8_cache: bool = False, num_seqs: int | None = None,
                 num_kv_splits: int | None = None) -> _TileConfig:
    """Decode: 16-row tiles (the dot only has to reach tensor-core size; the kernel is bound by
    K/V reads), 128 keys a step. Prefill: 128-row tiles, 64 keys a step, 8 warps (wgmma; with
    the block ids read a step ahead the fastest of the H100 probe in benchmarks/h100/
    prefill_attention.md, 128 keys a step before). Decode chosen from an H200 sweep
    (scripts/gpu_check_attention.py --sweep) at D = 128; every size
    here compiles for sm_90 without spilling, save a few bytes with splits and a window.
    fused_splits (decode splits merged in the kernel): 64 keys a step, so that a split can be
    as short as 64 keys (splits are whole steps): twice as many programs at short contexts; over
    a bf16 cache 2 stages, not 3: at 32 rows (2 splits) 3 stages took 1.33-1.49x as long at
    500-16,000 keys (204.3 against 143.6 us at 4,000), and 2 stages were as fast or faster from
    1 to 24 rows but for one point (2.5% slower); over an FP8 cache 3 stages stay, faster at 16-32
    rows (131.7 against 149.0 us at 32 x 4,000) (H200, benchmarks/h200/decode_attention_stages.md).
    Calls of one or two sequences (num_seqs) run those tiles on 8 warps, not 4: 1 row 11.7 -> 11.2
    us at 300 keys, 21.8 -> 18.8 at 4,000, 52.1 -> 43.6 at 16,000; 2 rows 4-15% faster at 300-16,000
    keys; from 4 rows 4 warps were as fast or faster but at 300 keys (H200, 30 us off a batch-1 decode
    step; benchmarks/h200/chain_configs.md).
    fp8_cache (prefill over an FP8 cache): 128 keys a step, 148 against 162 us for a 2048-token
    prompt (H200, benchmarks/h200/fp8_kv_cache.md); decode keeps its sizes (fastest there too).
    num_seqs: the call's sequences, which a fused decode tile needs (no default that would pick
    the 1-2-sequence warps for a caller that did not say).
    Unsplit decode (num_kv_splits 1: the one loop) over an FP8 cache at D 128: one warp a
    program, 32 keys a step, 3 stages, the parts loop with one part (_attend_keys_parts). H200,
    against 128 keys on 4 warps: 256 x 1,620 keys 218.7 against 284.0 us, 512 x 1,500 436.6
    against 534.3, 64 x 1,000 42.5 against 51.3; the 2-D loop on one warp 220.2 / 475.9 / 46.1,
    2 parts on 2 warps 298.0 / 559.0 / 52.2. Over a bf16 cache one warp gains nothing; 64 keys on
    2 warps (the 2-D loop) 392.8 / 724.1 / 65.6 against 402.2 / 735.7 / 68.7 on 4 warps at 128
    keys (alike in four calls); 1000 x 1000 at 256 rows 9,911 -> 10,068 out tok/s (a graph step
    19.41 -> 19.03 ms), at 128 rows 8,693 -> 8,882 (11.51 -> 11.19 ms), one call each
    (benchmarks/h200/fp8_decode.md sections 16, 18)."""
    if dtype == torch.float32:
        # An exact fp32 dot (input_precision="ieee") runs on the FMA units; only small tiles stay
        # out of local memory. fp32 on the GPU is a test path, not a fast one.
        return _TileConfig(16, 16 if head_dim >= 128 else 32, 4, 2)
    if max_seqlen_q == 1 and fused_splits:
        if head_dim == 256:
            return _TileConfig(16, 32, 4, 3)
        if fp8_cache:
            return _TileConfig(16, _FUSED_DECODE_BLOCK_N, 4, 3)
        if num_seqs is None:
            raise ValueError("a fused decode tile depends on the call's num_seqs (1-2 sequences take 8 warps)")
        return _TileConfig(16, _FUSED_DECODE_BLOCK_N, 8 if num_seqs <= 2 else 4, 2)
    if max_seqlen_q == 1 and num_kv_splits == 1 and head_dim == 128:
        return _TileConfig(16, 32, 1, 3, parts=1) if fp8_cache else _TileConfig(16, 64, 2, 3)
    if max_seqlen_q == 1:
        return _TileConfig(16, 32 if head_dim == 256 else 128, 4, 3)
    if head_dim == 256:
        return _TileConfig(64, 32, 8, 2)
    return _TileConfig(128, 128 if fp8_cache else 64, 8, 3)


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_seqlen_k: int,
                         num_sms: int = _H200_NUM_SMS, min_keys_per_split: int = 256,
                         max_splits: int = 64) -> int:
    """Splits per (sequence, kv head) for a decode call: enough programs for about two per SM,
    but no split shorter than min_keys_per_split keys (the partials cost a write and a merge)."""
    programs = max(num_seqs * num_kv_heads, 1)
    want = triton.cdiv(2 * num_sms, programs)
    cap = max(max_seqlen_k // min_keys_per_split, 1)
    return max(1, min(want, cap, max_splits))


def choose_fused_kv_splits(num_seqs: int, num_kv_heads: int, max_seqlen_k: int,
                           num_sms: int = _H200_NUM_SMS,
                           min_keys_per_split: int = _FUSED_DECODE_BLOCK_N,
                           max_splits: int = 16) -> int:
    """Splits per (sequence, kv head) for a decode call that merges them in the kernel.

    At small batches a decode program is bound by how fast one SM pulls its keys (H200, bf16,
    D 128: ~2.5 us per 128 keys of K and V, ~27 GB/s), while the in-kernel merge adds ~1-2 us on
    the critical path and no launch. So cut the keys until the programs fill the SMs as
    choose_num_kv_splits does (about two per SM), down to one 64-key step a split, at most 16
    splits (the last program merges them all). Batch 1 at 8 KV heads: 5 splits at 300 keys,
    8 at 511, 16 from 1000; 1 split from 33 sequences up (264 programs)."""
    programs = max(num_seqs * num_kv_heads, 1)
    want = triton.cdiv(2 * num_sms, programs)
    cap = triton.cdiv(max(max_seqlen_k, 1), min_keys_per_split)
    return max(1, min(want, cap, max_splits))


def _kv_ahead(max_seqlen_q: int, grid: tuple[int, int, int], num_kv_splits: int, device: torch.device) -> bool:
    """Load the next step's K and V ahead (_attend_keys) in split decode calls of at most one
    program per SM: there a program's wait for memory is the whole cost, and its registers crowd
    no other program. H100, batch 1 (benchmarks/h100/decode_experiments.md): 300 keys in 5
    splits 8.0 against 8.9 us, 1000 and 4000 keys in 16: 10.6 / 18.1 against 12.0 / 19.6; with
    many steps a split it was 1-3% slower, unsplit 2x slower (a long loop the compiler's own
    pipelining serves better), and with more programs than SMs up to 2x slower: off there."""
    real_programs = grid[0] * (grid[1] - 1) * grid[2]      # grid[1]'s last: the padding rows
    return max_seqlen_q == 1 and num_kv_splits > 1 and real_programs <= _num_sms(device)


def _one_loop(max_seqlen_q: int, num_kv_splits: int) -> bool:
    """Unsplit decode calls read their keys in one loop, the last block's mask on every step. The
    loop over the keys every row sees and the one over the last partial block (where a prompt
    tile's causal diagonal falls) are two pipelines: the second's loads cannot start during the
    first's steps. H200, bf16, 32 layers in a CUDA graph (benchmarks/h200/one_loop.md), one
    loop against two: unsplit calls (33 rows or more under the engine's fused split rule)
    1.5-11% faster up to 8,000 keys (256 rows: 300 keys 93.9 against 103.9 us, 2,000 keys 481.9
    against 491.9), 2.7% slower at 256 x 16,000 (more KV than an 8B model's cache holds); split
    calls (a few rows) faster over a few hundred keys, up to 10% slower over thousands. The
    masked steps' products round apart from the unmasked ones' fused multiply-add: the same
    values to within bf16's last bit."""
    return max_seqlen_q == 1 and num_kv_splits == 1


def _int32_offsets(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The key loop computes K/V offsets in int32 wherever the caches allow it (the same bits):
    prompt tiles ran 1.05-1.15x (H100, benchmarks/h100/prefill_attention.md), decode calls 2.7-3.2%
    faster (H200: 256 x 1620, 64 x 1000, 1 x 1000 keys; benchmarks/h200/fp8_kv_cache.md)."""
    return _offsets_fit_int32(k_cache, v_cache)


def _prompt_loop(max_seqlen_q: int, k_cache: torch.Tensor) -> bool:
    """The prompt tiles' key loop (`_attend_keys`' PROMPT: block ids a step ahead, K key by key):
    prompt tiles, and decode calls over an FP8 cache (H200, with int32 offsets: 256 x 1620 keys
    285 against 325 us, 64 x 1000 53.9 against 57.8; a bf16 cache's unsplit decode ran 5-12% slower in
    it: benchmarks/h200/fp8_kv_cache.md)."""
    return max_seqlen_q > 1 or k_cache.dtype in FP8_KV_DTYPES


def _offsets_fit_int32(*caches: torch.Tensor) -> bool:
    """Every element offset of the caches fits int32 (so the key loop may compute K/V addresses
    in int32): the largest, sum over dims of (size - 1) * |stride|, is below 2^31. A per-layer
    cache of 16-key pages, 8 kv heads of 128 holds up to 1M pages so."""
    return all(sum((n - 1) * abs(st) for n, st in zip(c.shape, c.stride())) < 2 ** 31 for c in caches)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _H200_NUM_SMS


def _check_inputs(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out):
    check_q_and_caches(q, k_cache, v_cache)
    for name, t in (("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    num_seqs = seq_lens.shape[0]
    if num_seqs >= _MAX_GRID_Y:
        raise ValueError(f"at most {_MAX_GRID_Y - 1} sequences per call (a CUDA grid dimension), got {num_seqs}")
    if block_table.dim() != 2 or block_table.shape[0] != num_seqs or cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(
            f"with {num_seqs} sequences, block_table must be [{num_seqs}, max_blocks] and cu_seqlens_q "
            f"[{num_seqs + 1}], got {tuple(block_table.shape)} and {tuple(cu_seqlens_q.shape)}")
    # The kernel steps through a table row and these vectors one element at a time.
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"block_table must have unit stride along its blocks, got strides {block_table.stride()}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens)):
        if t.shape[0] > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")
    tensors = (k_cache, v_cache, block_table, cu_seqlens_q, seq_lens) + ((out,) if out is not None else ())
    if any(t.device != q.device for t in tensors):
        raise ValueError("all tensors must be on q's device")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")


def check_q_and_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """What the attention kernels (this one and kernels/cascade_attention.py) need of q and the
    caches: their shapes, head counts and dims, the page size, the dtypes."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [T, Hq, D] and caches [num_blocks, block_size, Hkv, D], "
            f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"q has {num_heads} heads of dim {head_dim}; the cache has {num_kv_heads} kv heads of "
            f"dim {cache_head_dim}: the head dims must match and Hq must be a multiple of Hkv")
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {_HEAD_DIMS}, got {head_dim}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16 (16, 32, 64, ...), got {block_size}")
    check_cache_dtypes(q, k_cache, v_cache)


def check_cache_dtypes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """q in one of _DTYPES; both caches in q's dtype, or both FP8 (widened to q's dtype as read)."""
    if q.dtype not in _DTYPES or k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype,) + FP8_KV_DTYPES:
        raise ValueError(f"q must be one of {_DTYPES} and the caches share one dtype, q's or one of "
                         f"{FP8_KV_DTYPES}; got q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")


def paged_attention(
    q: torch.Tensor,             # [T, Hq, D], any strides
    k_cache: torch.Tensor,       # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,   # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,      # [B] int32
    scale: float,
    sliding_window: int | None = None,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_kv_splits: int | None = None,
    merge_in_kernel: bool = False,
    out: torch.Tensor | None = None,
    pdl: bool = False,
    kv_ahead: bool | None = None,
    prompt_loop: bool | None = None,
    i32_offsets: bool | None = None,
    one_loop: bool | None = None,
) -> torch.Tensor:
    """Causal paged attention of the new query rows, as `paged_attention_ref`. Returns [T, Hq, D].

    max_seqlen_q must be >= every sequence's q_len and max_seqlen_k >= every seq_len (neither is
    checked on the device; max_seqlen_k only sizes the split count). num_kv_splits=None: split-KV
    for decode calls (max_seqlen_q == 1) by `choose_num_kv_splits` (`choose_fused_kv_splits` with
    merge_in_kernel), none otherwise; any S >= 1 works for any batch. merge_in_kernel: the last
    program of each (sequence, tile, kv head) merges the splits, no second launch (same bits).
    out: optional [T, Hq, D] buffer (any strides) to write into. pdl: launch with programmatic
    dependent launch (kernels/pdl.py); the separate merge kernel, if any, is launched without.
    kv_ahead: load each step's K and V one step ahead (the same bits); None: where `_kv_ahead`
    found it faster (split decode calls of at most one program per SM). prompt_loop (the key
    loop of prompt tiles: block ids a step ahead, K key by key) and i32_offsets (int32 K/V
    offsets, where the caches allow) and one_loop (a decode call's keys in one masked loop): None,
    the rules (`_prompt_loop`, `_int32_offsets`, `_one_loop`); for probes (the same values: int32
    offsets the same bits, K read key by key and one loop the same to fp32 rounding).
    """
    _check_inputs(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out)
    check_pdl(pdl, q.device, "paged_attention")
    if max_seqlen_q < 1 or max_seqlen_k < 1:
        raise ValueError(f"max_seqlen_q and max_seqlen_k must be >= 1, got {max_seqlen_q}, {max_seqlen_k}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_kv_splits is None:
        choose = choose_fused_kv_splits if merge_in_kernel else choose_num_kv_splits
        num_kv_splits = 1 if max_seqlen_q > 1 else choose(
            num_seqs, num_kv_heads, max_seqlen_k, _num_sms(q.device))
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1 or None, got {num_kv_splits}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    merge_in_kernel = merge_in_kernel and num_kv_splits > 1
    cfg = _pick_config(max_seqlen_q, head_dim, q.dtype, fused_splits=merge_in_kernel,
                       fp8_cache=k_cache.dtype in FP8_KV_DTYPES, num_seqs=num_seqs, num_kv_splits=num_kv_splits)
    _launch(q, k_cache, v_cache, block_table, cu_seqlens_q.contiguous(), seq_lens.contiguous(),
            out, scale, sliding_window, max_seqlen_q, num_kv_splits, cfg, merge_in_kernel, pdl, kv_ahead,
            i32_offsets, prompt_loop, one_loop)
    return out


def _launch(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, scale, sliding_window,
            max_seqlen_q, num_kv_splits, cfg: _TileConfig, merge_in_kernel: bool = False,
            pdl: bool = False, kv_ahead: bool | None = None, i32_offsets: bool | None = None,
            prompt_loop: bool | None = None, one_loop: bool | None = None) -> None:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    block_m = max(cfg.block_q // g_pad, 1)
    num_m_tiles = triton.cdiv(max_seqlen_q, block_m)
    if num_kv_splits > 1:
        # fp32 partials of every (row, head, split); torch.empty is graph-safe (private pool).
        part_m = torch.empty(num_tokens, num_heads, num_kv_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_tokens, num_heads, num_kv_splits, head_dim,
                               dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out     # unused
    merge_in_kernel = merge_in_kernel and num_kv_splits > 1
    if merge_in_kernel:                      # one per (sequence, query tile, kv head)
        counters = arrival_counters("paged_attention", q.device, num_seqs * num_m_tiles * num_kv_heads)
    else:
        counters = block_table               # unused (an argument whose alignment is keyed anyway)
    grid = (num_m_tiles, num_seqs + 1, num_kv_heads * num_kv_splits)
    one_loop = _one_loop(max_seqlen_q, num_kv_splits) if one_loop is None else one_loop and max_seqlen_q == 1
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_m, part_l, part_acc, counters,
        block_table, cu_seqlens_q, seq_lens,
        scale * _LOG2E, sliding_window or 0, num_seqs, num_tokens, num_heads, num_m_tiles,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), block_table.stride(0),
        GROUP=group, G_PAD=g_pad, BLOCK_M=block_m, BLOCK_Q=block_m * g_pad,
        BLOCK_N=cfg.block_n, HEAD_DIM=head_dim, PAGE_SIZE=block_size,
        NUM_SPLITS=num_kv_splits, MERGE_IN_KERNEL=merge_in_kernel, HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", USE_PDL=pdl,
        KV_AHEAD=_kv_ahead(max_seqlen_q, grid, num_kv_splits, q.device) if kv_ahead is None else kv_ahead,
        PROMPT=_prompt_loop(max_seqlen_q, k_cache) if prompt_loop is None else prompt_loop,
        I32=_int32_offsets(k_cache, v_cache) if i32_offsets is None else
        i32_offsets and _offsets_fit_int32(k_cache, v_cache),
        ONE_LOOP=one_loop, PARTS=cfg.parts if one_loop else 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(pdl),
    )
    if num_kv_splits > 1 and not merge_in_kernel:
        rows = max(16 // g_pad, 1)
        _reduce_splits_kernel[(triton.cdiv(num_tokens, rows), num_kv_heads)](
            out, part_m, part_l, part_acc, cu_seqlens_q, num_seqs, num_heads, *out.stride(),
            GROUP=group, G_PAD=g_pad, ROWS=rows, NUM_SPLITS=num_kv_splits, HEAD_DIM=head_dim, num_warps=4,
        )
