"""What bounds the decode attention over an FP8 KV cache?

fp8_kv_cache.md: unsplit FP8 decode reads at ~3.0 TB/s of FP8 bytes where the bf16 cache's reads
run at ~4.0. This probe times one simplified unsplit decode kernel (the engine's loop: block ids
a step ahead, K key by key, the mask on every step; 16-row tiles holding a kv head's 4 query
heads, 128 keys a step, 4 warps, 3 stages) in these forms:

- `f16`: K and V widened to fp16, q in fp16, both dots in fp16 (the engine's form);
- `qk8`, `pv8`, `both8`: q (quantized in the kernel, a scale a row) or p (times 256) to e4m3 and
  that dot on the cache's bytes as they are. First call (dde5c3d): no faster than the engine's,
  and compiled for sm_90 they hold the same fp16 mma.sync as `f16`: a 16-row dot is mma.sync,
  which has no FP8 form on sm_90 (only wgmma has), so triton widens both operands anyway;
- `k_t`, `trans_first`, `int8`, `asm`: other ways to write K's load and widening (compiled for
  sm_90 on the CPU machine, the same code as `f16`);
- `v_regs`: V loaded a step ahead into registers (volatile: outside the compiler's pipelining),
  widened there, then into shared memory as fp16 for the dot. Compiled for sm_90 (`f16` against
  `v_regs`): `f16` reads V from shared memory a byte at a time (128 ld.shared.b8 a thread a
  step: the dot wants 4 keys' values of one column together, and V's rows are its columns'
  bytes apart; cp.async copies it in 8-byte pieces), `v_regs` none (ldmatrix on fp16);
- `k_regs`: the same for K (spills);
- `v_t`: the V cache transposed in each page ([blocks, kv heads, D, page], keys contiguous), read
  as V^T [D, BLOCK_N] in 16-byte pieces (a page's 16 keys; offsets hinted contiguous, the mask
  whole pages); the dot takes its transpose, K-contiguous as an 8-bit operand wants. Compiled for
  sm_90: no byte loads, 146 registers against `f16`'s 244, 1,288 SASS instructions against
  1,944; timed, at most 2% faster (thirty-seventh session);
- `wsplit{W}_{keys}_s{stages}[_r{maxnreg}]` (its own kernel, `_warp_split_kernel`): a step's
  keys cut into W parts, each its own online softmax through batched dots, a warp each;
  `wsplit2_64_s3` ran 15-16% faster than the engine's 2-D tile, the form the engine took
  (`_attend_keys_parts`); `_r`: a cap on a thread's registers; `_vt`: V's cache as `v_t` has it;
- `_s2` / `_s4` suffixes: 2 or 4 pipeline stages; `_hm`: head-major caches ([blocks, kv heads,
  page, D]); `_hf`: a sequence's kv heads side by side in the grid;

and, for scale, the same kernel over a bf16 cache (`bf16`, `bf16_v_regs`, `bf16_v_t`, `bf16_hf`,
`bf16_hm`, and `bf16_<form>` for each of --bf16-forms) and the engine's own kernel over both
caches (`engine_fp8`, `engine_bf16`, over head-major views `engine_*_hm`, and with other decode
tiles `engine_*_<keys,warps,stages,parts>` for each of --engine-configs). Each FP8 form's error
against the fp32 reference on the same FP8 cache is reported.

    PYTHONPATH=. python3 benchmarks/h200/fp8_decode/fp8_dot_probe.py --out $OUT/fp8_dot.json
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/h200/fp8_decode/fp8_dot_probe.py --cpu-check
"""
import argparse
import json
import os

import torch
import triton
import triton.language as tl

HQ, HKV, D, PAGE, GROUP = 32, 8, 128, 16, 4
# form: (K's form, q.K on FP8 tensor cores, p.V on FP8 tensor cores)
FORMS = {"f16": (0, False, False), "qk8": (0, True, False), "pv8": (0, False, True), "both8": (0, True, True),
         "k_t": (1, False, False), "trans_first": (2, False, False), "swap": (3, False, False),
         "int8": (4, False, False), "asm": (5, False, False), "k_regs": (6, False, False),
         "v_regs": (7, False, False), "v_t": (8, False, False)}


@triton.jit
def _e4m3_bytes_to_f16(x):
    """int8 tensor of e4m3 bytes -> fp16, four at a time (two cvt.rn.f16x2.e4m3x2 a 32-bit word)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _load_q(q_ptr, seq, kv_head, HEAD_DIM: tl.constexpr, NUM_KV: tl.constexpr, G: tl.constexpr):
    """A kv head's G query heads of one decode row as a 16-row fp32 tile (rows past G zero), their
    head numbers, which rows are real, and the head dim's offsets."""
    rows = tl.arange(0, 16)
    head = kv_head * G + rows
    row_ok = rows < G
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (seq * NUM_KV * G + head)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    return q, head, row_ok, offs_d


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, lens_ptr, qk_scale, stride_bt,
                   K_FORM: tl.constexpr, QK8: tl.constexpr, PV8: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_KV: tl.constexpr, G: tl.constexpr,
                   HEAD_MAJOR: tl.constexpr = False, HEADS_FAST: tl.constexpr = False):
    if HEADS_FAST:      # a sequence's kv heads run side by side (their K/V rows share DRAM pages)
        seq = tl.program_id(1)
        kv_head = tl.program_id(0)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    # head-major caches, [blocks, kv heads, page, D]: a page's keys of one head are contiguous
    KEY_STRIDE: tl.constexpr = HEAD_DIM if HEAD_MAJOR else NUM_KV * HEAD_DIM
    q, head, row_ok, offs_d = _load_q(q_ptr, seq, kv_head, HEAD_DIM, NUM_KV, G)
    # the dtype the widened values take: fp16 over an FP8 cache (the engine's), else the cache's
    wide: tl.constexpr = tl.float16 if k_ptr.dtype.element_ty == tl.float8e4nv else k_ptr.dtype.element_ty
    q_scale = tl.maximum(tl.max(tl.abs(q), axis=1), 1e-12) / 448.0
    if QK8:
        q_dot = (q / q_scale[:, None]).to(tl.float8e4nv)
    else:
        q_dot = q.to(wide)
    seq_len = tl.load(lens_ptr + seq)
    seq_pad = tl.multiple_of((seq_len + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE, PAGE_SIZE)
    table_row = table_ptr + seq * stride_bt
    kv_off = kv_head * (PAGE_SIZE * HEAD_DIM if HEAD_MAJOR else HEAD_DIM)
    m_i = tl.full([16], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([16], dtype=tl.float32)
    acc = tl.zeros([16, HEAD_DIM], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    ids = tl.load(table_row + offs_n // PAGE_SIZE, mask=offs_n < seq_len, other=0)
    if K_FORM == 6:     # K a step ahead in registers, outside the compiler's pipelining (volatile)
        k_next = tl.load(k_ptr + (ids * (PAGE_SIZE * NUM_KV * HEAD_DIM) + (offs_n % PAGE_SIZE) * KEY_STRIDE
                                  + kv_off)[:, None] + offs_d[None, :],
                         mask=(offs_n < seq_len)[:, None], other=0.0, volatile=True)
    if K_FORM == 7:     # V a step ahead in registers, outside the compiler's pipelining (volatile)
        v_next = tl.load(v_ptr + (ids * (PAGE_SIZE * NUM_KV * HEAD_DIM) + (offs_n % PAGE_SIZE) * KEY_STRIDE
                                  + kv_off)[:, None] + offs_d[None, :],
                         mask=(offs_n < seq_len)[:, None], other=0.0, volatile=True)
    for start in range(0, seq_len, BLOCK_N):
        k_pos = start + offs_n
        k_in = k_pos < seq_len
        nxt = k_pos + BLOCK_N
        next_ids = tl.load(table_row + nxt // PAGE_SIZE, mask=nxt < seq_len, other=0)
        base = (ids * (PAGE_SIZE * NUM_KV * HEAD_DIM) + (k_pos % PAGE_SIZE) * KEY_STRIDE + kv_off)
        ptrs = base[:, None] + offs_d[None, :]
        if K_FORM == 1:     # K loaded as [D, BLOCK_N]: the dot's B operand as it stands
            k = tl.load(k_ptr + base[None, :] + offs_d[:, None], mask=k_in[None, :], other=0.0)
        elif K_FORM == 6:
            k = k_next
            nxt_base = (next_ids * (PAGE_SIZE * NUM_KV * HEAD_DIM) + (nxt % PAGE_SIZE) * KEY_STRIDE + kv_off)
            k_next = tl.load(k_ptr + nxt_base[:, None] + offs_d[None, :], mask=(nxt < seq_len)[:, None], other=0.0,
                             volatile=True)
        elif K_FORM == 4:   # K's bytes as int8
            k = tl.load(k_ptr.to(tl.pointer_type(tl.int8)) + ptrs, mask=k_in[:, None], other=0)
        elif K_FORM == 5:
            k = tl.load(k_ptr.to(tl.pointer_type(tl.int8)) + ptrs, mask=k_in[:, None], other=0)
        else:
            k = tl.load(k_ptr + ptrs, mask=k_in[:, None], other=0.0)
        if K_FORM == 7:
            v = v_next
            nxt_base = (next_ids * (PAGE_SIZE * NUM_KV * HEAD_DIM) + (nxt % PAGE_SIZE) * KEY_STRIDE + kv_off)
            v_next = tl.load(v_ptr + nxt_base[:, None] + offs_d[None, :], mask=(nxt < seq_len)[:, None], other=0.0,
                             volatile=True)
        elif K_FORM == 8:   # V's cache transposed in each page, [blocks, kv heads, D, page]: V^T [D, BLOCK_N]
            # Keys are contiguous within a page (16) and a page starts aligned; the mask is whole
            # pages (the last page's stale keys are finite and masked out of p), so 16-byte loads.
            key_off = tl.max_contiguous(tl.multiple_of(
                ids * (PAGE_SIZE * NUM_KV * HEAD_DIM) + kv_head * (HEAD_DIM * PAGE_SIZE) + k_pos % PAGE_SIZE,
                PAGE_SIZE), PAGE_SIZE)
            page_in = tl.multiple_of(start, BLOCK_N) + offs_n < seq_pad
            v = tl.load(v_ptr + offs_d[:, None] * PAGE_SIZE + key_off[None, :], mask=page_in[None, :], other=0.0)
        else:
            v = tl.load(v_ptr + ptrs, mask=k_in[:, None], other=0.0)
        ids = next_ids
        if QK8:
            s = tl.dot(q_dot, tl.trans(k)) * (q_scale * qk_scale)[:, None]
        elif K_FORM == 1:
            s = tl.dot(q_dot, k.to(wide)) * qk_scale
        elif K_FORM == 2:   # transposed, then widened
            s = tl.dot(q_dot, tl.trans(k).to(wide)) * qk_scale
        elif K_FORM == 4:
            s = tl.dot(q_dot, tl.trans(k.to(tl.float8e4nv, bitcast=True).to(wide))) * qk_scale
        elif K_FORM == 5:
            s = tl.dot(q_dot, tl.trans(_e4m3_bytes_to_f16(k))) * qk_scale
        elif K_FORM == 3:   # K as the dot's A operand: s^T = K q^T, [BLOCK_N, 16]
            s = tl.trans(tl.dot(k.to(wide), tl.trans(q_dot))) * qk_scale
        else:               # widened, then transposed (the engine's)
            s = tl.dot(q_dot, tl.trans(k.to(wide))) * qk_scale
        s = tl.where(k_in[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if PV8:
            acc = acc * alpha[:, None] + tl.dot((p * 256.0).to(tl.float8e4nv), v) * (1.0 / 256.0)
        elif K_FORM == 8:
            acc = acc * alpha[:, None] + tl.dot(p.to(wide), tl.trans(v.to(wide)))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(wide), v.to(wide))
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (seq * NUM_KV * G + head)[:, None] * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _warp_split_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, lens_ptr, qk_scale, stride_bt,
                       BLOCK_N: tl.constexpr, W: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                       NUM_KV: tl.constexpr, G: tl.constexpr, V_T: tl.constexpr = False):
    """The `wsplit` forms: a step's keys cut into W parts, each its own online softmax through
    batched (3-D) dots, which triton's mma layout gives a warp each ([W, 1, 1] warps); no
    reduction or exchange between warps inside the key loop, the W partials merged once at the
    end. Block ids a step ahead, K key by key, widened to fp16 (the engine's FP8 form). V_T: V's
    cache transposed in each page, read as `v_t` reads it."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q, head, row_ok, offs_d = _load_q(q_ptr, seq, kv_head, HEAD_DIM, NUM_KV, G)
    wide: tl.constexpr = tl.float16 if k_ptr.dtype.element_ty == tl.float8e4nv else k_ptr.dtype.element_ty
    if wide == tl.float16:
        q = tl.minimum(tl.maximum(q, -65504.0), 65504.0)
    q3 = tl.broadcast_to(q.to(wide)[None, :, :], (W, 16, HEAD_DIM))
    NW: tl.constexpr = BLOCK_N // W
    key = tl.arange(0, W)[:, None] * NW + tl.arange(0, NW)[None, :]          # [W, NW] a step's keys
    seq_len = tl.load(lens_ptr + seq)
    seq_pad = tl.multiple_of((seq_len + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE, PAGE_SIZE)
    table_row = table_ptr + seq * stride_bt
    m_i = tl.full([W, 16], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([W, 16], dtype=tl.float32)
    acc = tl.zeros([W, 16, HEAD_DIM], dtype=tl.float32)
    ids = tl.load(table_row + key // PAGE_SIZE, mask=key < seq_len, other=0)
    for start in range(0, seq_len, BLOCK_N):
        k_pos = start + key
        k_in = k_pos < seq_len
        nxt = k_pos + BLOCK_N
        next_ids = tl.load(table_row + nxt // PAGE_SIZE, mask=nxt < seq_len, other=0)
        base = ids * (PAGE_SIZE * NUM_KV * HEAD_DIM) + (k_pos % PAGE_SIZE) * (NUM_KV * HEAD_DIM) + kv_head * HEAD_DIM
        ptrs = base[:, :, None] + offs_d[None, None, :]
        k = tl.load(k_ptr + ptrs, mask=k_in[:, :, None], other=0.0)            # [W, NW, D]
        if V_T:     # [W, D, NW]: a page's keys contiguous, whole pages (see `v_t`)
            key_off = tl.max_contiguous(tl.multiple_of(
                ids * (PAGE_SIZE * NUM_KV * HEAD_DIM) + kv_head * (HEAD_DIM * PAGE_SIZE) + k_pos % PAGE_SIZE,
                [1, PAGE_SIZE]), [1, PAGE_SIZE])
            page_in = tl.multiple_of(start, BLOCK_N) + key < seq_pad
            v = tl.load(v_ptr + offs_d[None, :, None] * PAGE_SIZE + key_off[:, None, :], mask=page_in[:, None, :],
                        other=0.0)
        else:
            v = tl.load(v_ptr + ptrs, mask=k_in[:, :, None], other=0.0)
        ids = next_ids
        s = tl.dot(q3, tl.trans(k.to(wide), (0, 2, 1))) * qk_scale               # [W, 16, NW]
        s = tl.where(k_in[:, None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=2))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)       # a part may have seen no key yet
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, :, None])
        l_i = l_i * alpha + tl.sum(p, axis=2)
        if V_T:
            acc = acc * alpha[:, :, None] + tl.dot(p.to(wide), tl.trans(v.to(wide), (0, 2, 1)))
        else:
            acc = acc * alpha[:, :, None] + tl.dot(p.to(wide), v.to(wide))
        m_i = m_new
    m = tl.max(m_i, axis=0)                                                     # [16]
    w = tl.exp2(m_i - m[None, :])
    l = tl.sum(l_i * w, axis=0)
    out = tl.sum(acc * w[:, :, None], axis=0) / l[:, None]
    tl.store(out_ptr + (seq * NUM_KV * G + head)[:, None] * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def head_major(cache):
    """[blocks, page, kv heads, D] -> [blocks, kv heads, page, D] (the `_hm` forms' caches)."""
    return cache.permute(0, 2, 1, 3).contiguous()


def v_transposed(v_cache):
    """[blocks, page, kv heads, D] -> [blocks, kv heads, D, page]: the `v_t` form's V cache."""
    return v_cache.permute(0, 2, 3, 1).contiguous()


def decode(q, k_cache, v_cache, table, lens, form, scale, v_t=None):
    """v_t: the V cache as v_transposed gives it (made once, outside the timing) for `v_t`."""
    batch = lens.numel()
    out = torch.empty_like(q)
    if form.startswith("wsplit"):   # wsplit{W}_{keys a step}_s{stages}[_r{maxnreg}][_vt]: W warps, a part each
        w, bn, st, *more = form[len("wsplit"):].split("_")
        reg = [int(m[1:]) for m in more if m.startswith("r")]
        v_cache = (v_t if v_t is not None else v_transposed(v_cache)) if "vt" in more else v_cache
        _warp_split_kernel[(batch, HKV)](q, k_cache, v_cache, out, table, lens, scale * 1.4426950408889634,
                                         table.stride(0), BLOCK_N=int(bn), W=int(w), HEAD_DIM=D, PAGE_SIZE=PAGE,
                                         NUM_KV=HKV, G=GROUP, V_T="vt" in more, num_warps=int(w),
                                         num_stages=int(st[1:]), **({"maxnreg": reg[0]} if reg else {}))
        return out
    stages, head_major, heads_fast = 3, False, False
    if form.endswith("_hf"):
        form, heads_fast = form[:-3], True
    if form.endswith("_hm"):        # the caches as head_major gives them (made outside the timing)
        form, head_major = form[:-3], True
    if form.endswith("_s2") or form.endswith("_s4"):
        form, stages = form[:-3], int(form[-1])
    if FORMS[form][0] == 8:
        v_cache = v_t if v_t is not None else v_transposed(v_cache)
    grid = (HKV, batch) if heads_fast else (batch, HKV)
    _decode_kernel[grid](q, k_cache, v_cache, out, table, lens, scale * 1.4426950408889634,
                                 table.stride(0), K_FORM=FORMS[form][0], QK8=FORMS[form][1], PV8=FORMS[form][2], BLOCK_N=128, HEAD_DIM=D,
                                 PAGE_SIZE=PAGE, NUM_KV=HKV, G=GROUP, HEAD_MAJOR=head_major, HEADS_FAST=heads_fast,
                         num_warps=4, num_stages=stages)
    return out


def make_case(batch, ctx, device, dtype, seed=0):
    from kernels.attention_ref import to_cache_dtype
    per_seq = -(-ctx // PAGE)
    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(batch * per_seq, PAGE, HKV, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(batch * per_seq, PAGE, HKV, D, device=device, dtype=dtype, generator=g)
    table = torch.randperm(batch * per_seq, device=device, generator=g).to(torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    q = torch.randn(batch, HQ, D, device=device, dtype=dtype, generator=g)
    fp8 = torch.float8_e4m3fn
    return q, (k, v), (to_cache_dtype(k, fp8), to_cache_dtype(v, fp8)), table, lens


def reference(q, k, v, table, lens, scale):
    from kernels.attention_ref import paged_attention_ref
    batch = lens.numel()
    cu = torch.arange(batch + 1, device=q.device, dtype=torch.int32)
    return paged_attention_ref(q, k, v, table, cu, lens, scale)


def cpu_check() -> None:
    """The f16 form against the reference under the interpreter (float32 q; its FP8 dots are the
    GPU's)."""
    q, _, (k8, v8), table, lens = make_case(3, 200, torch.device("cpu"), torch.float32)
    ref = reference(q, k8, v8, table, lens, D ** -0.5)
    k8h, v8h = head_major(k8), head_major(v8)
    for form in ("f16", "k_t", "trans_first", "v_regs", "k_regs", "v_t", "f16_hf", "f16_hm", "f16_hm_hf",
                 "wsplit4_128_s3", "wsplit2_64_s3", "wsplit8_256_s2", "wsplit1_32_s3_r168",
                 "wsplit1_32_s3_vt", "wsplit2_64_s3_vt"):
        got = decode(q, *((k8h, v8h) if "_hm" in form else (k8, v8)), table, lens, form, D ** -0.5)
        err = float((got - ref).abs().max())
        print(form, "form vs reference, max abs err", err)
        assert err < 2e-2, err


def _with_tile(pa, tile, fn, maxnreg=None):
    """fn() with the engine's kernel given `tile` for its decode call and, with maxnreg, a cap on
    a thread's registers (ptxas) in its launch."""
    picked, kernel = pa._pick_config, pa._paged_attention_kernel

    class Capped:       # kernel[grid](...) with maxnreg added to the launch options
        def __getitem__(self, grid):
            return lambda *a, **kw: kernel[grid](*a, **kw, maxnreg=maxnreg)
    pa._pick_config = lambda *a, **k: tile
    if maxnreg:
        pa._paged_attention_kernel = Capped()
    try:
        return fn()
    finally:
        pa._pick_config, pa._paged_attention_kernel = picked, kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["256x1620", "512x1500", "64x1000"])
    ap.add_argument("--forms", nargs="+", default=["f16", "v_regs", "v_regs_s2", "v_regs_s4", "k_regs", "qk8"])
    ap.add_argument("--bf16-forms", nargs="*", default=[], help="forms also timed over the bf16 cache")
    ap.add_argument("--engine-configs", nargs="*", default=[],
                    help="the engine's kernel with these decode tiles as well: keys,warps,stages,parts[,maxnreg] "
                         "each, over both caches (engine_{fp8,bf16}_<config>)")
    ap.add_argument("--cpu-check", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.cpu_check:
        cpu_check()
        return
    import kernels.paged_attention as pa
    from engine.gemm_tuning import replay_ms
    dev = torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("BENCH_COMMIT", "?"), "cases": []}
    for case in args.cases:
        batch, ctx = (int(x) for x in case.split("x"))
        q, (kb, vb), (k8, v8), table, lens = make_case(batch, ctx, dev, torch.bfloat16)
        scale = D ** -0.5
        cu = torch.arange(batch + 1, device=dev, dtype=torch.int32)
        ref = reference(q, k8, v8, table, lens, scale).float() if batch * ctx <= 300_000 else None
        row = {"case": case, "us": {}, "max_abs_err": {}, "mean_abs_err": {}}
        vt8, k8h, v8h = v_transposed(v8), head_major(k8), head_major(v8)
        runs = {f: (lambda f=f: decode(q, *((k8h, v8h) if "_hm" in f else (k8, v8)), table, lens, f, scale, vt8))
                for f in args.forms}
        runs["bf16"] = lambda: decode(q, kb, vb, table, lens, "f16", scale)
        runs["bf16_v_regs"] = lambda: decode(q, kb, vb, table, lens, "v_regs", scale)
        vtb, kbh, vbh = v_transposed(vb), head_major(kb), head_major(vb)
        runs["bf16_v_t"] = lambda: decode(q, kb, vb, table, lens, "v_t", scale, vtb)
        runs["bf16_hf"] = lambda: decode(q, kb, vb, table, lens, "f16_hf", scale)
        runs["bf16_hm"] = lambda: decode(q, kbh, vbh, table, lens, "f16_hm", scale)
        for f in args.bf16_forms:
            runs["bf16_" + f] = lambda f=f: decode(q, kb, vb, table, lens, f, scale)
        # the engine's kernel over head-major caches: views in its [blocks, page, kv heads, D] order
        for name, kc, vc in (("engine_fp8", k8, v8), ("engine_bf16", kb, vb),
                             ("engine_fp8_hm", k8h.permute(0, 2, 1, 3), v8h.permute(0, 2, 1, 3)),
                             ("engine_bf16_hm", kbh.permute(0, 2, 1, 3), vbh.permute(0, 2, 1, 3))):
            runs[name] = (lambda kc=kc, vc=vc: pa.paged_attention(
                q, kc, vc, table, cu, lens, scale, max_seqlen_q=1, max_seqlen_k=ctx, num_kv_splits=1,
                merge_in_kernel=True))
        for cfg_text in args.engine_configs:
            bn, nw, st, parts, *reg = (int(x) for x in cfg_text.split(","))
            tile, cap = pa._TileConfig(16, bn, nw, st, parts), (reg[0] if reg else None)
            for name, kc, vc in (("engine_fp8_" + cfg_text, k8, v8), ("engine_bf16_" + cfg_text, kb, vb)):
                runs[name] = (lambda kc=kc, vc=vc, tile=tile, cap=cap: _with_tile(pa, tile, lambda: pa.paged_attention(
                    q, kc, vc, table, cu, lens, scale, max_seqlen_q=1, max_seqlen_k=ctx, num_kv_splits=1,
                    merge_in_kernel=True), cap))
        for name, fn in runs.items():
            try:
                us = replay_ms(lambda: [fn() for _ in range(32)], dev) * 1e3 / 32
            except Exception as e:      # a form that does not compile: say so, go on
                row["us"][name] = f"failed: {type(e).__name__}: {str(e)[:300]}"
                print(case, name, "failed", e, flush=True)
                continue
            row["us"][name] = round(us, 2)
            if ref is not None and "bf16" not in name:
                diff = (fn().float() - ref).abs()
                row["max_abs_err"][name] = float(diff.max())
                row["mean_abs_err"][name] = float(diff.mean())
            print(case, name, f"{us:.2f} us", row["max_abs_err"].get(name), flush=True)
        fp8_bytes = 2 * batch * ctx * HKV * D
        row["tb_per_s"] = {n: round((2 if "bf16" in n else 1) * fp8_bytes / (u * 1e-6) / 1e12, 3)
                           for n, u in row["us"].items() if isinstance(u, float)}
        result["cases"].append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
