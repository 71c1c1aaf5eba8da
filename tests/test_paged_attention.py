"""The Triton paged attention against the eager reference, on mixed batches.

Without CUDA the kernels run in Triton's interpreter (set up by tests/kernel_support.py); if
that does not take, every test fails rather than skipping. With CUDA the same tests run on the
GPU, bf16 included, plus the CUDA-graph checks.
"""
import pytest
import torch

from kernels.attention_ref import to_cache_dtype
from scripts.bench_common import capture_graph
from tests.kernel_support import DEVICE, ON_GPU, load_kernels, require_runnable

pa = load_kernels("kernels.paged_attention")
choose_num_kv_splits, choose_fused_kv_splits, paged_attention, paged_attention_ref = (
    pa.choose_num_kv_splits, pa.choose_fused_kv_splits, pa.paged_attention, pa.paged_attention_ref)


@pytest.fixture(autouse=True)
def kernels_can_run_here():
    require_runnable(pa)


# The interpreter turns scalar arrays into loop bounds through a numpy call it deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

TOLS = {torch.float32: (1e-4, 1.3e-6), torch.float16: (1e-2, 1e-3), torch.bfloat16: (1.5e-2, 1e-2)}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])

# Decode rows (context 5, 70, 1), a whole prompt (37 of 37), an empty row, a later prompt chunk
# over a cached prefix (20 new of 60), a decode row at context 100.
MIXED_Q = [1, 1, 37, 0, 20, 1, 1]
MIXED_CTX = [5, 70, 37, 3, 60, 100, 1]


def make_batch(q_lens, ctx_lens, hq, hkv, d, block_size, dtype, seed, pad_rows=3, q_view=None):
    """Random q and scattered cache blocks. q has pad_rows rows past cu_seqlens_q[-1].
    q_view="rows": q is a slice of a fused [T, Hq + 2 Hkv, D] tensor; "dim": every other column."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in ctx_lens) + 5
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(-(-n // block_size) for n in ctx_lens) + 1
    table = torch.full((len(ctx_lens), max_blocks), num_blocks + 1000, dtype=torch.int32)  # junk past the end
    for b, n in enumerate(ctx_lens):
        table[b, :-(-n // block_size)] = torch.tensor([perm.pop() for _ in range(-(-n // block_size))])
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    num_tokens = int(cu[-1]) + pad_rows
    to = lambda t: t.to(DEVICE, dtype if t.is_floating_point() else t.dtype)  # noqa: E731
    if q_view == "rows":
        q = to(torch.randn(num_tokens, hq + 2 * hkv, d, generator=g))[:, :hq]
    elif q_view == "dim":
        q = to(torch.randn(num_tokens, hq, 2 * d, generator=g))[:, :, ::2]
    else:
        q = to(torch.randn(num_tokens, hq, d, generator=g))
    return (q, to(k_cache), to(v_cache), to(table), to(cu), to(torch.tensor(ctx_lens, dtype=torch.int32)))


def check(args, q_lens, ctx_lens, sliding_window=None, num_kv_splits=None, max_seqlen_q=None,
          merge_in_kernel=False, kv_ahead=None, one_loop=None):
    """Run the kernel into a NaN-poisoned buffer and compare every element with the reference."""
    q = args[0]
    scale = q.shape[-1] ** -0.5
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    got = paged_attention(*args, scale, sliding_window, max_seqlen_q=max_seqlen_q or max(q_lens),
                          max_seqlen_k=max(ctx_lens), num_kv_splits=num_kv_splits,
                          merge_in_kernel=merge_in_kernel, out=out, kv_ahead=kv_ahead, one_loop=one_loop)
    assert got is out
    ref = paged_attention_ref(*args, scale, sliding_window)
    atol, rtol = TOLS[q.dtype]
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,window", [(4, 4, 32, None), (4, 2, 16, 7), (8, 2, 64, None)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_reference(dtype, hq, hkv, d, window, block_size):
    args = make_batch(MIXED_Q, MIXED_CTX, hq, hkv, d, block_size, dtype, seed=hq * 7 + d + block_size)
    check(args, MIXED_Q, MIXED_CTX, sliding_window=window)


@pytest.mark.parametrize("window", [1, 16, 33])
@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_sliding_window(window, num_kv_splits):
    args = make_batch(MIXED_Q, MIXED_CTX, 8, 2, 32, 16, torch.float32, seed=window)
    check(args, MIXED_Q, MIXED_CTX, sliding_window=window, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_long_window_with_unmasked_middle(num_kv_splits):
    # A window several key steps wide: masked start, unmasked middle, masked diagonal.
    q_lens, ctx = [1, 50, 1, 1], [400, 300, 170, 20]
    args = make_batch(q_lens, ctx, 4, 2, 16, 16, torch.float16, seed=9)
    check(args, q_lens, ctx, sliding_window=150, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_splits", [2, 3, 8])
def test_split_kv_decode(dtype, num_kv_splits):
    # Short contexts: with 8 splits most splits of most rows see no key at all.
    q_lens, ctx = [1, 1, 1, 0, 1, 1], [1, 17, 64, 9, 100, 33]
    args = make_batch(q_lens, ctx, 8, 2, 32, 16, dtype, seed=num_kv_splits)
    check(args, q_lens, ctx, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("num_kv_splits,merge_in_kernel", [(1, False), (2, False), (3, False), (3, True)])
def test_rows_before_the_first_sequence_are_left_alone(num_kv_splits, merge_in_kernel):
    """A call over sequences whose rows start past row 0 (cu_seqlens_q[0] > 0: the prompt-chunk
    call of engine/models/attention.py's _mixed_paged_attention reads its rows of q in place,
    after the decode rows another call owns) writes its rows and zeroes the padding after them,
    and leaves the rows before them as they were, with or without split-KV."""
    q_lens, ctx = [1, 1, 1, 9, 14], [40, 70, 33, 30, 90]
    q, k, v, table, cu, lens = make_batch(q_lens, ctx, 4, 2, 16, 16, torch.float32, seed=11)
    scale = q.shape[-1] ** -0.5
    ref = paged_attention_ref(q, k, v, table, cu, lens, scale)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    got = paged_attention(q, k, v, table[3:], cu[3:], lens[3:], scale, max_seqlen_q=14, max_seqlen_k=90,
                          num_kv_splits=num_kv_splits, merge_in_kernel=merge_in_kernel, out=out)
    assert got[:3].isnan().all(), "rows of the decode call's were written"
    atol, rtol = TOLS[q.dtype]
    torch.testing.assert_close(got[3:], ref[3:], atol=atol, rtol=rtol)


def test_split_kv_on_a_mixed_batch():
    args = make_batch(MIXED_Q, MIXED_CTX, 4, 2, 16, 16, torch.float32, seed=5)
    check(args, MIXED_Q, MIXED_CTX, num_kv_splits=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("chunk_tensors", [False, True])
def test_mixed_step_runs_decode_rows_apart(dtype, window, chunk_tensors):
    """engine/models/attention.py: a mixed step's leading decode rows in one call (decode
    tiles), its prompt chunks (an empty row, a one-token chunk among them) in another, into one
    output: the same as the reference over the whole batch, padding rows zeroed."""
    from engine.models.attention import AttentionMetadata, _mixed_paged_attention
    q_lens, ctx = [1, 1, 1, 37, 0, 20, 1], [5, 70, 100, 37, 3, 60, 9]
    q, k_cache, v_cache, table, cu, seq_lens = make_batch(q_lens, ctx, 8, 2, 32, 16, dtype,
                                                          seed=21)
    meta = AttentionMetadata(slot_mapping=None, block_table=table, cu_seqlens_q=cu,
                             seq_lens=seq_lens, max_seqlen_q=37, max_seqlen_k=100, num_decodes=3)
    if chunk_tensors:       # what the runner passes: the chunks' own (aligned) tensors
        meta.chunk_block_table = table[3:].clone()
        meta.chunk_cu_seqlens_q = cu[3:].clone()
        meta.chunk_seq_lens = seq_lens[3:].clone()
    scale = q.shape[-1] ** -0.5
    got = _mixed_paged_attention(paged_attention, q, k_cache, v_cache, meta, scale, window)
    ref = paged_attention_ref(q, k_cache, v_cache, table, cu, seq_lens, scale, window)
    atol, rtol = TOLS[dtype]
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    assert not got.isnan().any()


def test_decode_picks_splits_itself():
    q_lens, ctx = [1, 1], [700, 300]
    assert choose_num_kv_splits(2, 1, max(ctx)) > 1
    args = make_batch(q_lens, ctx, 4, 1, 16, 32, torch.float16, seed=2)
    check(args, q_lens, ctx, num_kv_splits=None)


def test_choose_num_kv_splits():
    assert choose_num_kv_splits(64, 8, 32768) == 1              # 512 programs fill 132 SMs
    assert choose_num_kv_splits(1, 8, 100) == 1                 # too short to be worth a merge
    one_long = choose_num_kv_splits(1, 8, 32768)
    assert 8 * one_long >= 132 and one_long <= 64
    assert choose_num_kv_splits(16, 8, 8192) > 1
    assert choose_num_kv_splits(1, 8, 1024) <= 1024 // 256
    assert choose_num_kv_splits(1, 1, 10**6, max_splits=64) == 64


@pytest.mark.parametrize("dtype", DTYPES)
def test_prompt_longer_than_several_tiles(dtype):
    d, hq, hkv = 16, 4, 2
    cfg = pa._pick_config(2, d, dtype)
    block_m = cfg.block_q // 2
    q_lens = [2 * block_m + 5, 1, block_m + 1]
    ctx = [2 * block_m + 5, 40, block_m + 50]
    args = make_batch(q_lens, ctx, hq, hkv, d, 16, dtype, seed=11, pad_rows=0)
    check(args, q_lens, ctx)
    check(args, q_lens, ctx, sliding_window=block_m // 2 + 3)


@pytest.mark.parametrize("q_view", ["rows", "dim"])
def test_strided_q_and_out(q_view):
    args = make_batch(MIXED_Q, MIXED_CTX, 4, 2, 32, 16, torch.float16, seed=3, q_view=q_view)
    q = args[0]
    assert not q.is_contiguous()
    check(args, MIXED_Q, MIXED_CTX)
    # out may be a view too: the first Hq heads of a wider buffer.
    wide = torch.full((q.shape[0], q.shape[1] + 3, q.shape[2]), float("nan"), dtype=q.dtype, device=q.device)
    got = paged_attention(*args, 0.2, max_seqlen_q=max(MIXED_Q), max_seqlen_k=max(MIXED_CTX),
                          out=wide[:, :q.shape[1]])
    torch.testing.assert_close(got, paged_attention_ref(*args, 0.2), atol=1e-2, rtol=1e-3)
    assert wide[:, q.shape[1]:].isnan().all()


def test_head_dim_256():
    q_lens, ctx = [1, 9, 1], [20, 30, 50]
    args = make_batch(q_lens, ctx, 2, 1, 256, 16, torch.float16, seed=4)
    check(args, q_lens, ctx)


def test_only_padding_rows_and_a_zero_q_batch():
    q_lens, ctx = [0, 0], [5, 9]
    args = make_batch(q_lens, ctx, 2, 1, 16, 16, torch.float32, seed=6, pad_rows=4)
    got = check(args, q_lens, ctx, max_seqlen_q=1)
    assert torch.equal(got, torch.zeros_like(got))


def test_a_wrong_cache_entry_changes_only_its_sequence():
    q_lens, ctx = [1, 1, 1], [20, 30, 7]
    q, k_cache, v_cache, table, cu, lens = make_batch(q_lens, ctx, 4, 2, 16, 16, torch.float32, seed=3)
    run = lambda: paged_attention(q, k_cache, v_cache, table, cu, lens, 0.3,  # noqa: E731
                                  max_seqlen_q=1, max_seqlen_k=30, num_kv_splits=2)
    before = run()
    v_cache[int(table[1, 1])] += 1.0            # the block holding positions 16..29 of sequence 1
    after = run()
    assert not torch.allclose(before[1], after[1])
    assert torch.equal(before[0], after[0]) and torch.equal(before[2], after[2])


@pytest.mark.parametrize("change,match", [
    (dict(block_size=8), "block_size must be a power of two >= 16"),
    (dict(block_size=48), "block_size must be a power of two >= 16"),
    (dict(d=48), "head_dim must be one of"),
    (dict(hkv=3), "multiple of Hkv"),
])
def test_rejects_unsupported_shapes(change, match):
    shape = dict(hq=4, hkv=2, d=16, block_size=16) | change
    args = make_batch([1], [5], shape["hq"], shape["hkv"], shape["d"], shape["block_size"],
                      torch.float32, seed=0)
    with pytest.raises(ValueError, match=match):
        paged_attention(*args, 0.25, max_seqlen_q=1, max_seqlen_k=5)


def test_rejects_block_tables_and_vectors_it_would_read_as_contiguous():
    """A column-major block table (its values right, strides (1, B)) was read as if row-major:
    every output wrong. Such tables and strided cu_seqlens_q / seq_lens are refused."""
    q, k, v, table, cu, lens = make_batch([1, 1], [33, 40], 2, 1, 16, 16, torch.float32, seed=0)
    col_major = table.t().contiguous().t()
    assert torch.equal(col_major, table) and col_major.stride(1) != 1
    with pytest.raises(ValueError, match="block_table must have unit stride along its blocks"):
        paged_attention(q, k, v, col_major, cu, lens, 0.25, max_seqlen_q=1, max_seqlen_k=40)
    strided = torch.stack([cu, cu], 1)[:, 0]
    with pytest.raises(ValueError, match="cu_seqlens_q must be contiguous"):
        paged_attention(q, k, v, table, strided, lens, 0.25, max_seqlen_q=1, max_seqlen_k=40)
    strided = torch.stack([lens, lens], 1)[:, 0]
    with pytest.raises(ValueError, match="seq_lens must be contiguous"):
        paged_attention(q, k, v, table, cu, strided, 0.25, max_seqlen_q=1, max_seqlen_k=40)


def test_rejects_more_sequences_than_a_grid_axis_holds():
    n = 65535
    q, k_cache, v_cache = torch.zeros(n, 2, 16), torch.zeros(2, 16, 1, 16), torch.zeros(2, 16, 1, 16)
    table, lens = torch.zeros(n, 1, dtype=torch.int32), torch.ones(n, dtype=torch.int32)
    cu = torch.arange(n + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="at most 65534 sequences"):
        paged_attention(q, k_cache, v_cache, table, cu, lens, 0.25, max_seqlen_q=1, max_seqlen_k=1)


def test_rejects_mismatched_dtypes():
    q, k_cache, v_cache, table, cu, lens = make_batch([1], [5], 4, 2, 16, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="share one dtype"):
        paged_attention(q.half(), k_cache, v_cache, table, cu, lens, 0.25, max_seqlen_q=1, max_seqlen_k=5)
    with pytest.raises(ValueError, match="block_table must be int32"):
        paged_attention(q, k_cache, v_cache, table.long(), cu, lens, 0.25, max_seqlen_q=1, max_seqlen_k=5)


FP8 = torch.float8_e4m3fn


def fp8_caches(args):
    """The batch with its caches as an FP8 KV cache holds them (EngineConfig.kv_cache_dtype)."""
    q, k_cache, v_cache, *rest = args
    return (q, to_cache_dtype(k_cache, FP8), to_cache_dtype(v_cache, FP8), *rest)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_splits,merge_in_kernel", [(None, False), (3, False), (4, True)])
def test_fp8_caches_match_reference(dtype, num_kv_splits, merge_in_kernel):
    """FP8 caches, read and widened to q's dtype: a mixed batch (decode rows, a prompt in prompt
    tiles, a chunk over a cached prefix) as the reference computes it on the same caches."""
    args = fp8_caches(make_batch(MIXED_Q, MIXED_CTX, 8, 2, 32, 16, dtype, seed=13))
    check(args, MIXED_Q, MIXED_CTX, num_kv_splits=num_kv_splits, merge_in_kernel=merge_in_kernel)
    # Not the answer of the unrounded caches: the test sees the FP8 values.
    plain = make_batch(MIXED_Q, MIXED_CTX, 8, 2, 32, 16, dtype, seed=13)
    scale = 32 ** -0.5
    assert not torch.allclose(paged_attention_ref(*args, scale), paged_attention_ref(*plain, scale),
                              atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kv_ahead", [False, True])
def test_fp8_caches_in_split_decode_with_keys_ahead(kv_ahead):
    q_lens, ctx = [1, 1, 1], [300, 70, 5]
    args = fp8_caches(make_batch(q_lens, ctx, 8, 2, 32, 16, torch.float32, seed=14))
    check(args, q_lens, ctx, num_kv_splits=8, merge_in_kernel=True, kv_ahead=kv_ahead)


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_in_the_prompt_tiles_key_loop_gives_the_same_bits(fp8):
    """The probes' overrides (scripts/gpu_fp8_attention.py): a decode call run with the prompt
    tiles' key loop and int32 offsets gives what the decode loop gives (K read key by key and
    transposed for the dot: the same values to fp32 rounding)."""
    q_lens, ctx = [1, 1, 1], [300, 70, 5]
    args = make_batch(q_lens, ctx, 8, 2, 32, 16, torch.float32, seed=15)
    args = fp8_caches(args) if fp8 else args
    run = lambda **kw: paged_attention(*args, 32 ** -0.5, max_seqlen_q=1, max_seqlen_k=300, **kw)  # noqa: E731
    plain = run(prompt_loop=False, i32_offsets=False)
    prompt_loop = run(prompt_loop=True, i32_offsets=True)
    torch.testing.assert_close(prompt_loop, plain, atol=1e-6, rtol=1e-5)
    assert torch.equal(run(prompt_loop=False, i32_offsets=True), plain)
    assert torch.equal(run(), prompt_loop if fp8 else plain)     # the rule: FP8 decode takes the prompt loop


def test_rejects_caches_of_two_dtypes():
    q, k_cache, v_cache, table, cu, lens = make_batch([1], [5], 4, 2, 16, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="share one dtype"):
        paged_attention(q, to_cache_dtype(k_cache, FP8), v_cache, table, cu, lens, 0.25, max_seqlen_q=1,
                        max_seqlen_k=5)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs and sync checks need a GPU")
@pytest.mark.parametrize("num_kv_splits,merge_in_kernel", [(1, False), (4, False), (8, True)])
def test_cuda_graph_replay_follows_new_lengths(num_kv_splits, merge_in_kernel):
    """Captured once; new seq_lens / cu_seqlens_q / tables written in place change the result."""
    q_lens, ctx = [1, 1, 1, 1], [300, 40, 129, 1]
    q, k_cache, v_cache, table, cu, lens = make_batch(q_lens, ctx, 8, 2, 64, 16, torch.bfloat16, seed=8)
    call = lambda: paged_attention(q, k_cache, v_cache, table, cu, lens, 0.125,  # noqa: E731
                                   max_seqlen_q=2, max_seqlen_k=320, num_kv_splits=num_kv_splits,
                                   merge_in_kernel=merge_in_kernel)
    torch.cuda.set_sync_debug_mode("error")     # any host read of a device value raises
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph, out = capture_graph(call)
    # Next step: sequence 0 decodes again, sequence 2 now runs a 2-token chunk, 3 is gone.
    lens.copy_(torch.tensor([301, 41, 131, 5], dtype=torch.int32))
    cu.copy_(torch.tensor([0, 1, 2, 4, 4], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention_ref(q, k_cache, v_cache, table, cu, lens, 0.125)
    torch.testing.assert_close(out, ref, atol=1.5e-2, rtol=1e-2)


# ---- splits merged inside the kernel (merge_in_kernel) --------------------------------------

def _counters_of(device) -> torch.Tensor:
    from kernels.arrival_counters import arrival_counters
    return arrival_counters("paged_attention", torch.device(device) if isinstance(device, str) else device, 0)


# Decode rows of lengths 1, a block's worth, past a 64-key step, not multiples of the block, an
# empty row; a group of 3 query heads (padded to 4 in the tile) besides 4 and 1.
FUSED_Q = [1, 1, 1, 0, 1, 1, 1]
FUSED_CTX = [1, 16, 70, 9, 129, 33, 200]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,window", [(8, 2, 32, None), (6, 2, 16, 40), (4, 4, 64, None), (3, 1, 32, 7)])
@pytest.mark.parametrize("num_kv_splits", [2, 3, 16])
def test_merge_in_kernel_matches_reference(dtype, hq, hkv, d, window, num_kv_splits):
    args = make_batch(FUSED_Q, FUSED_CTX, hq, hkv, d, 16, dtype, seed=hq + d + num_kv_splits)
    check(args, FUSED_Q, FUSED_CTX, sliding_window=window, num_kv_splits=num_kv_splits,
          merge_in_kernel=True)
    assert _counters_of(args[0].device).count_nonzero() == 0


@pytest.mark.parametrize("window", [None, 16])
def test_merge_in_kernel_on_a_mixed_batch(window):
    # Prompt tiles too: a counter per (sequence, query tile, kv head).
    args = make_batch(MIXED_Q, MIXED_CTX, 4, 2, 16, 16, torch.float32, seed=15)
    check(args, MIXED_Q, MIXED_CTX, sliding_window=window, num_kv_splits=3, merge_in_kernel=True)
    assert _counters_of(args[0].device).count_nonzero() == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_splits,window", [(2, None), (5, None), (8, 50), (16, None)])
def test_merge_in_kernel_is_bitwise_the_merge_kernel(dtype, num_kv_splits, window):
    """With the same tiling the two paths store the same partials, and both merge them with
    `_merge_splits` (the same operations in the same split order; the max is exact): bitwise
    equal, not only within fp32 rounding. (The public call tiles a fused decode 64 keys a step,
    the separate merge 128, so there they agree to rounding only: compared in the test above.)"""
    q_lens, ctx = [1, 1, 1, 1, 0, 1], [300, 1, 47, 129, 5, 64]
    q, k_cache, v_cache, table, cu, lens = make_batch(q_lens, ctx, 8, 2, 32, 16, dtype, seed=num_kv_splits)
    cfg = pa._pick_config(1, 32, dtype, fused_splits=True, num_seqs=len(q_lens))
    got = {}
    for fused in (True, False):       # fused first: its workspace holds no partials of the other
        out = torch.full(q.shape, float("nan"), dtype=dtype, device=q.device)
        pa._launch(q, k_cache, v_cache, table, cu, lens, out, 0.2, window, 1, num_kv_splits, cfg, fused)
        got[fused] = out
    assert torch.equal(got[True], got[False])
    torch.testing.assert_close(got[True], paged_attention_ref(q, k_cache, v_cache, table, cu, lens, 0.2, window),
                               atol=TOLS[dtype][0], rtol=TOLS[dtype][1])


def test_merge_in_kernel_leaves_counters_at_zero_and_repeats_bitwise():
    """The last program of each head sets its counter back to 0: the next call (a graph replay)
    finds every counter zeroed and merges again; the same inputs give the same bits, new values
    new results. (The interpreter runs programs one after another, so which program is last is
    fixed here; scripts/gpu_check_decode_kernels.py repeats graph replays on the GPU.)"""
    q_lens, ctx = [1, 1, 1], [200, 33, 1]
    q, k_cache, v_cache, table, cu, lens = make_batch(q_lens, ctx, 8, 2, 32, 16, torch.float32, seed=12)
    run = lambda: paged_attention(q, k_cache, v_cache, table, cu, lens, 0.3, max_seqlen_q=1,  # noqa: E731
                                  max_seqlen_k=200, num_kv_splits=4, merge_in_kernel=True)
    first = run()
    counters = _counters_of(q.device)
    assert counters.count_nonzero() == 0
    assert torch.equal(run(), first)
    v_cache[int(table[0, 5])] += 1.0             # positions 80..95 of sequence 0
    again = run()
    assert not torch.allclose(again[0], first[0]) and torch.equal(again[1:], first[1:])
    torch.testing.assert_close(again, paged_attention_ref(q, k_cache, v_cache, table, cu, lens, 0.3),
                               atol=1e-4, rtol=1.3e-6)
    assert counters.count_nonzero() == 0


def test_merge_in_kernel_picks_its_splits_itself():
    q_lens, ctx = [1], [300]
    assert choose_fused_kv_splits(1, 2, 300) == 5         # cdiv(300, 64)
    args = make_batch(q_lens, ctx, 4, 2, 16, 16, torch.float16, seed=13)
    check(args, q_lens, ctx, merge_in_kernel=True)


def test_choose_fused_kv_splits():
    # Batch 1 of a Llama-3.1-8B-shaped model (8 KV heads): many splits even at short contexts.
    assert choose_fused_kv_splits(1, 8, 300) == 5           # one 64-key step each
    assert choose_fused_kv_splits(1, 8, 511) == 8
    assert choose_fused_kv_splits(1, 8, 1023) == 16
    assert choose_fused_kv_splits(1, 8, 32767) == 16        # the last program merges them all
    assert choose_fused_kv_splits(4, 8, 4000) == 9          # cdiv(264, 32): two programs per SM
    assert choose_fused_kv_splits(16, 8, 4000) == 3
    assert choose_fused_kv_splits(64, 8, 4000) == 1         # 512 programs fill the SMs already
    assert choose_fused_kv_splits(1, 8, 1) == 1 and choose_fused_kv_splits(1, 8, 64) == 1
    assert choose_fused_kv_splits(1, 8, 65) == 2            # two 64-key steps
    for b in (1, 2, 3, 4, 8, 16, 24, 32, 40):
        for ctx in (1, 100, 300, 511, 1000, 4000, 32767):
            s = choose_fused_kv_splits(b, 8, ctx)
            assert 1 <= s <= min(16, -(-ctx // 64))
            # never fewer than the separate merge picks, but where that wants more than 16
            assert s >= choose_num_kv_splits(b, 8, ctx) or s == 16


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_merge_in_kernel_graph_replays_agree_bitwise():
    """On the GPU the last program of a head is whichever finishes last: replays of one graph
    (the programs racing differently each time) give the same bits and the separate merge's."""
    q_lens, ctx = [1] * 4, [300, 1000, 77, 1]
    q, k_cache, v_cache, table, cu, lens = make_batch(q_lens, ctx, 32, 8, 128, 16, torch.bfloat16, seed=14)
    cfg = pa._pick_config(1, 128, torch.bfloat16, fused_splits=True, num_seqs=len(q_lens))
    want = torch.empty_like(q)
    pa._launch(q, k_cache, v_cache, table, cu, lens, want, 0.088, None, 1, 16, cfg)
    out = torch.empty_like(q)
    call = lambda: pa._launch(q, k_cache, v_cache, table, cu, lens, out, 0.088, None, 1, 16, cfg, True)  # noqa: E731
    graph, _ = capture_graph(call)
    for _ in range(200):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    assert _counters_of(q.device).count_nonzero() == 0


@pytest.mark.parametrize("merge_in_kernel,num_kv_splits,window", [(True, 4, None), (False, 2, 7), (False, 3, None),
                                                                  (True, 2, 50)])
def test_decode_loading_the_next_keys_ahead_changes_no_bits(merge_in_kernel, num_kv_splits, window):
    """Decode calls load step i + 1's K and V before step i's math (kv_ahead): the same values
    into the same operations, so the same bits as loading each step's keys in it, over whole
    steps and masked ones, windows and splits."""
    q_lens, ctx = [1, 1, 1, 1, 1], [300, 1, 47, 129, 64]
    args = make_batch(q_lens, ctx, 8, 2, 32, 16, torch.float32, seed=23)
    assert pa._kv_ahead(1, (1, len(q_lens) + 1, 2 * num_kv_splits), num_kv_splits, args[0].device)   # in the rule
    got = {}
    for ahead in (None, False, True):
        got[ahead] = check(args, q_lens, ctx, sliding_window=window, num_kv_splits=num_kv_splits,
                           merge_in_kernel=merge_in_kernel, kv_ahead=ahead)
    assert torch.equal(got[True], got[False]) and torch.equal(got[None], got[True])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_splits,window", [(1, None), (1, 7), (3, None), (2, 50)])
def test_decode_keys_in_one_masked_loop_match_the_two_loops(dtype, num_kv_splits, window):
    """Unsplit decode calls read their keys in one loop, masked at every step (`_one_loop`);
    forced either way, split or not, with and without a window, over contexts of whole steps,
    partial ones and a single key, both forms equal the reference and each other."""
    q_lens, ctx = [1, 1, 1, 1, 1, 1], [300, 1, 47, 129, 64, 16]
    args = make_batch(q_lens, ctx, 8, 2, 32, 16, dtype, seed=37)
    got = {one: check(args, q_lens, ctx, sliding_window=window, num_kv_splits=num_kv_splits, one_loop=one)
           for one in (True, False)}
    atol, rtol = TOLS[dtype]
    torch.testing.assert_close(got[True], got[False], atol=atol, rtol=rtol)


def _with_parts(monkeypatch, parts):
    """Unsplit decode calls in `parts` key parts of a 64-key step, a warp each (the rule takes
    the parts loop only at D 128 over FP8)."""
    picked = pa._pick_config

    def pick(max_seqlen_q, *a, num_kv_splits=None, **k):
        if max_seqlen_q == 1 and num_kv_splits == 1:
            return pa._TileConfig(16, 64, parts, 3, parts=parts)
        return picked(max_seqlen_q, *a, num_kv_splits=num_kv_splits, **k)
    monkeypatch.setattr(pa, "_pick_config", pick)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("parts,window", [(1, None), (2, None), (2, 7), (4, 50)])
def test_decode_keys_in_parts_match_reference(monkeypatch, dtype, fp8, parts, window):
    """Unsplit decode's key loop in parts (`_attend_keys_parts`: each part of a step its own
    online softmax, merged once after the loop), over contexts of whole steps, partial ones, a
    single key and fewer keys than parts, with and without a window (its ragged start in the
    2-D loop before), FP8 caches or not: the reference's values."""
    _with_parts(monkeypatch, parts)
    q_lens, ctx = [1, 1, 1, 1, 1, 1, 1], [300, 1, 47, 129, 64, 16, 20]
    args = make_batch(q_lens, ctx, 8, 2, 32, 16, dtype, seed=41)
    check(fp8_caches(args) if fp8 else args, q_lens, ctx, sliding_window=window, num_kv_splits=1)


def test_key_parts_only_in_the_one_loop(monkeypatch):
    """A decode call forced out of the one loop (or split) runs the 2-D loops, parts or not."""
    _with_parts(monkeypatch, 2)
    q_lens, ctx = [1, 1, 1], [300, 33, 95]
    args = make_batch(q_lens, ctx, 8, 2, 32, 16, torch.float32, seed=43)
    check(args, q_lens, ctx, num_kv_splits=1, one_loop=False)
    check(args, q_lens, ctx, num_kv_splits=3)


def test_unsplit_decode_tiles_at_d128():
    """The rule (_pick_config): an FP8 cache's unsplit decode at D 128 in one part on one warp,
    32 keys a step, a bf16 cache's on 2 warps at 64 keys; split calls, other head sizes and
    prompts keep the 2-D tiles of before."""
    bf16 = torch.bfloat16
    cfg = pa._pick_config(1, 128, bf16, fp8_cache=True, num_kv_splits=1)
    assert (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.parts) == (32, 1, 3, 1)
    assert pa._pick_config(1, 128, bf16, num_kv_splits=1) == pa._TileConfig(16, 64, 2, 3)
    assert pa._pick_config(1, 128, bf16, num_kv_splits=4) == pa._TileConfig(16, 128, 4, 3)
    assert pa._pick_config(1, 128, bf16, fp8_cache=True, num_kv_splits=4).parts == 0
    assert pa._pick_config(1, 128, bf16, fused_splits=True, fp8_cache=True, num_seqs=2, num_kv_splits=4).parts == 0
    assert pa._pick_config(1, 64, bf16, fp8_cache=True, num_kv_splits=1).parts == 0
    assert pa._pick_config(16, 128, bf16, fp8_cache=True, num_kv_splits=1).parts == 0
    assert pa._pick_config(1, 128, torch.float32, fp8_cache=True, num_kv_splits=1).parts == 0


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
@pytest.mark.parametrize("fp8,window", [(False, None), (False, 7), (True, None)])
def test_unsplit_decode_at_d128_in_the_rules_tiles_matches_reference(dtype, fp8, window):
    """The rule's own unsplit decode tiles at D 128 (above: 2 warps at 64 keys over a 16-bit
    cache, one warp in one part over an FP8 one), over contexts of whole steps, partial ones
    and a single key: the reference's values."""
    q_lens, ctx = [1, 1, 1, 1, 1], [130, 1, 64, 33, 97]
    args = make_batch(q_lens, ctx, 4, 1, 128, 16, dtype, seed=47)
    check(fp8_caches(args) if fp8 else args, q_lens, ctx, sliding_window=window, num_kv_splits=1)


def test_only_unsplit_decode_calls_read_their_keys_in_one_loop():
    assert pa._one_loop(1, 1)
    assert not pa._one_loop(1, 4)           # split decode: long contexts at a few rows ran slower
    assert not pa._one_loop(7, 1)           # prompt tiles: their causal diagonal's loop apart


@pytest.mark.parametrize("q_lens,ctx,splits", [
    ([1, 1, 1, 1, 1], [300, 1, 47, 129, 64], 4),                  # decode, split
    ([1, 1, 1], [300, 33, 95], 1),                                # decode, unsplit
    ([5, 1, 40, 3], [5, 200, 140, 67], 1),                        # prompt tiles (the PROMPT key loop)
])
def test_int32_and_int64_key_offsets_give_the_same_bits(q_lens, ctx, splits):
    """The key loop's K/V offsets in int32 (when the caches allow) or int64: the same addresses,
    so the same values into the same operations; both equal to the reference."""
    args = make_batch(q_lens, ctx, 8, 2, 32, 16, torch.float32, seed=31)
    assert pa._offsets_fit_int32(args[1], args[2])          # the default here: int32
    scale = 32 ** -0.5
    ref = paged_attention_ref(*args, scale)
    got = {}
    for i32 in (True, False):
        out = torch.full(args[0].shape, float("nan"), device=args[0].device)
        cfg = pa._pick_config(max(q_lens), 32, torch.float32)
        pa._launch(*args, out, scale, None, max(q_lens), splits, cfg, i32_offsets=i32)
        torch.testing.assert_close(out, ref, atol=TOLS[torch.float32][0], rtol=TOLS[torch.float32][1])
        got[i32] = out
    assert torch.equal(got[True], got[False])


def test_int32_key_offsets_where_every_offset_fits_and_the_prompt_loop_for_prompts_and_fp8():
    page = 16 * 8 * 128                                                   # elements of one 16-key page
    fits = torch.empty(2 ** 31 // page, 16, 8, 128, device="meta")        # last offset 2^31 - 1
    too_big = torch.empty(2 ** 31 // page + 1, 16, 8, 128, device="meta")
    assert pa._offsets_fit_int32(fits, fits)
    assert not pa._offsets_fit_int32(fits, too_big)
    wide = torch.empty(1000, 16, 2 ** 20, 128, device="meta")[:, :, :8]  # strided view of a huge cache
    assert not pa._offsets_fit_int32(wide)
    assert pa._int32_offsets(fits, fits) and not pa._int32_offsets(fits, too_big)
    bf16 = torch.empty(4, 16, 8, 128, dtype=torch.bfloat16, device="meta")
    fp8 = torch.empty(4, 16, 8, 128, dtype=torch.float8_e4m3fn, device="meta")
    assert pa._prompt_loop(2, bf16) and not pa._prompt_loop(1, bf16)          # decode: its own loop
    assert pa._prompt_loop(1, fp8) and pa._prompt_loop(2, fp8)                # FP8: the prompt loop


def test_the_next_keys_are_loaded_ahead_only_in_split_decode_calls_of_one_program_per_sm():
    dev = torch.device("cpu")                               # counted as an H200's 132 SMs
    assert pa._kv_ahead(1, (1, 2, 8 * 16), 16, dev)          # batch 1, 8 kv heads, 16 splits: 128
    assert not pa._kv_ahead(1, (1, 3, 8 * 16), 16, dev)      # batch 2: 256 programs
    assert not pa._kv_ahead(1, (1, 2, 8), 1, dev)            # unsplit
    assert not pa._kv_ahead(2, (1, 2, 16), 2, dev)           # a prompt chunk


def test_fused_decode_tile_needs_the_calls_sequence_count():
    """One or two sequences take a fused decode tile on 8 warps, more on 4; a caller that does
    not say how many gets an error, not the few-sequence tile."""
    bf16 = torch.bfloat16
    assert pa._pick_config(1, 128, bf16, fused_splits=True, num_seqs=2).num_warps == 8
    assert pa._pick_config(1, 128, bf16, fused_splits=True, num_seqs=3).num_warps == 4
    with pytest.raises(ValueError, match="num_seqs"):
        pa._pick_config(1, 128, bf16, fused_splits=True)
    assert pa._pick_config(1, 128, bf16).num_warps == 4          # split merged apart: no count needed
