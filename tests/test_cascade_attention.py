"""The Triton cascade attention against its eager reference and the plain paged-attention kernel.

Without CUDA the kernels run in Triton's interpreter (set up by tests/kernel_support.py); if that
does not take, every test fails rather than skipping. With CUDA the same tests run on the GPU,
bf16 included, plus the CUDA-graph check. The cost rule: tests/test_cascade_cost.py.
"""
import dataclasses

import pytest
import torch

from kernels.attention_ref import to_cache_dtype
from scripts.bench_common import capture_graph
from tests.kernel_support import DEVICE, ON_GPU, load_kernels, require_runnable

ca = load_kernels("kernels.cascade_attention")
pa = load_kernels("kernels.paged_attention")
cascade_attention, cascade_attention_ref = ca.cascade_attention, ca.cascade_attention_ref


@pytest.fixture(autouse=True)
def kernels_can_run_here():
    require_runnable(ca)
    require_runnable(pa)


# The interpreter turns scalar arrays into loop bounds through a numpy call it deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

TOLS = {torch.float32: (1e-4, 1.3e-6), torch.float16: (1e-2, 1e-3), torch.bfloat16: (1.5e-2, 1e-2)}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
BS = 16

# (prefix_len, [(q_len, own_len), ...]): own_len = seq_len - prefix_len, q rows at its end.
# Decode rows over 5 and 123 own tokens, a prefill chunk of 7 over 20 own, a whole own prompt
# (9 of 9), a group of one, groups of 1..4 members with prefixes of 1..4 blocks.
MIXED_GROUPS = [
    (32, [(1, 5), (1, 123), (7, 20), (1, 1)]),
    (48, [(9, 9), (1, 17)]),
    (16, [(5, 5)]),
    (64, [(1, 2), (1, 40), (3, 3)]),
]
MIXED_LONE = [(1, 40), (11, 11), (0, 7)]   # (q_len, seq_len); the last has no rows this step


def make_batch(groups, lone, hq, hkv, d, dtype, seed, pad_rows=3, empty_groups=0, lone_first=False):
    """Random q and K/V over scattered cache blocks; each group's prefix blocks appear once in the
    cache and at the head of every member's block table. Lone requests come after the grouped
    sequences (past cu_group_seqs[-1]), or with lone_first before them as one prefix-0 group.
    empty_groups: capacity padding at the end of cu_group_seqs, as a CUDA graph would carry."""
    g = torch.Generator().manual_seed(seed)
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    seqs = []                       # (q_len, seq_len, prefix_len, prefix block ids or None)
    num_blocks = sum(cdiv(p, BS) for p, _ in groups) + 5
    num_blocks += sum(cdiv(own, BS) for _, members in groups for _, own in members)
    num_blocks += sum(cdiv(n, BS) for _, n in lone)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    take = lambda n: [perm.pop() for _ in range(n)]  # noqa: E731
    lone_seqs = [(q_len, n, 0, []) for q_len, n in lone]
    group_seqs = []
    for prefix_len, members in groups:
        prefix_blocks = take(prefix_len // BS)
        group_seqs.append([(q_len, prefix_len + own, prefix_len, prefix_blocks) for q_len, own in members])
    sizes = [len(m) for m in group_seqs]
    if lone_first:
        group_seqs.insert(0, lone_seqs)
        sizes.insert(0, len(lone_seqs))
        lone_seqs = []
    seqs = [s for members in group_seqs for s in members] + lone_seqs
    max_blocks = max(cdiv(n, BS) for _, n, _, _ in seqs) + 1
    table = torch.full((len(seqs), max_blocks), num_blocks + 1000, dtype=torch.int32)  # junk past the end
    for b, (_, n, prefix_len, prefix_blocks) in enumerate(seqs):
        ids = prefix_blocks + take(cdiv(n, BS) - len(prefix_blocks))
        table[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, BS, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, BS, hkv, d, generator=g)
    q_lens = [s[0] for s in seqs]
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    cu_groups = [0]
    for n in sizes:
        cu_groups.append(cu_groups[-1] + n)
    cu_groups += [cu_groups[-1]] * empty_groups
    q = torch.randn(int(cu[-1]) + pad_rows, hq, d, generator=g)
    to = lambda t: t.to(DEVICE, dtype if t.is_floating_point() else t.dtype)  # noqa: E731
    i32 = lambda xs: to(torch.tensor(xs, dtype=torch.int32))  # noqa: E731
    args = (to(q), to(k_cache), to(v_cache), to(table), to(cu), i32([s[1] for s in seqs]),
            i32([s[2] for s in seqs]), i32(cu_groups))
    rows_per_group = [sum(s[0] for s in members) for members in group_seqs]
    limits = dict(max_seqlen_q=max(max(q_lens), 1), max_group_rows=max(rows_per_group + [1]),
                  max_prefix_len=max([p for p, _ in groups] + [0]))
    return args, limits


def run(args, limits, num_prefix_splits=None, out=None, own_decode_seqs=None, own_prompt_seqs=None,
        prompt_prefixes=True, side_by_side=False, **overrides):
    q = args[0]
    return cascade_attention(*args, q.shape[-1] ** -0.5, **(limits | overrides),
                             num_prefix_splits=num_prefix_splits, out=out,
                             own_decode_seqs=own_decode_seqs, own_prompt_seqs=own_prompt_seqs,
                             prompt_prefixes=prompt_prefixes, side_by_side=side_by_side)


def check(args, limits, num_prefix_splits=None, **overrides):
    """Run the kernel into a NaN-poisoned buffer and compare every element with the reference."""
    q = args[0]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    got = run(args, limits, num_prefix_splits, out=out, **overrides)
    assert got is out
    assert not got.isnan().any(), "some output element was never written"
    ref = cascade_attention_ref(*args, q.shape[-1] ** -0.5)
    atol, rtol = TOLS[q.dtype]
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 32), (4, 4, 16)])      # GQA 4:1, MHA
def test_mixed_groups_match_reference(dtype, hq, hkv, d):
    args, limits = make_batch(MIXED_GROUPS, MIXED_LONE, hq, hkv, d, dtype, seed=hq + d)
    check(args, limits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_prefix_splits", [1, 3])
def test_fp8_caches_match_reference(dtype, num_prefix_splits):
    """FP8 caches (EngineConfig.kv_cache_dtype): both passes widen the keys and values to q's
    dtype as they read them."""
    (q, k_cache, v_cache, *rest), limits = make_batch(MIXED_GROUPS, MIXED_LONE, 8, 2, 32, dtype, seed=9)
    fp8 = torch.float8_e4m3fn
    check((q, to_cache_dtype(k_cache, fp8), to_cache_dtype(v_cache, fp8), *rest), limits, num_prefix_splits)


def own_lists(args):
    """(one-row sequences, the others with rows) of a batch, as the engine lists them."""
    cu = args[4].cpu()
    q_lens = (cu[1:] - cu[:-1]).tolist()
    ids = lambda keep: torch.tensor([b for b, n in enumerate(q_lens) if keep(n)],  # noqa: E731
                                    dtype=torch.int32, device=args[0].device)
    return ids(lambda n: n == 1), ids(lambda n: n > 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_prefix_splits", [1, 3])
def test_own_pass_apart_for_decode_rows_matches_reference(dtype, num_prefix_splits):
    """A mixed step's own pass in two launches (decode tiles for the one-row sequences, prompt
    tiles for the others, each over the sequences it lists): the reference's values, every row
    written (NaN-poisoned output), the padding rows zeroed by the second."""
    args, limits = make_batch(MIXED_GROUPS, MIXED_LONE, 8, 2, 32, dtype, seed=17)
    decodes, prompts = own_lists(args)
    assert len(decodes) == 7 and len(prompts) == 5          # and a sequence with no rows
    got = check(args, limits, num_prefix_splits, own_decode_seqs=decodes, own_prompt_seqs=prompts)
    assert not got[-3:].any()                                # the padding rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_prefix_splits", [1, 3])
@pytest.mark.parametrize("lone_first", [False, True])
def test_passes_side_by_side_give_the_same_bits(dtype, num_prefix_splits, lone_first):
    """side_by_side: the prefix pass beside the own pass, a merge kernel folding their partials
    as the own pass folds them in turn: bit for bit the same output, every row written, the
    padding rows zeroed; lone rows (prefix 0, before or after the groups) written by the own pass."""
    args, limits = make_batch(MIXED_GROUPS, MIXED_LONE, 8, 2, 32, dtype, seed=23, lone_first=lone_first)
    in_turn = check(args, limits, num_prefix_splits)
    side = check(args, limits, num_prefix_splits, side_by_side=True)
    assert torch.equal(side, in_turn)
    assert not side[-3:].any()


def test_side_by_side_with_no_group_or_own_lists_runs_in_turn():
    """No group, or the own pass apart (own lists): nothing to run beside it; the flag is a no-op."""
    args, limits = make_batch([], MIXED_LONE, 8, 2, 32, torch.float32, seed=5)
    torch.testing.assert_close(check(args, limits, side_by_side=True), check(args, limits), rtol=0, atol=0)
    args, limits = make_batch(MIXED_GROUPS, MIXED_LONE, 8, 2, 32, torch.float32, seed=17)
    decodes, prompts = own_lists(args)
    got = check(args, limits, own_decode_seqs=decodes, own_prompt_seqs=prompts, side_by_side=True)
    assert torch.equal(got, check(args, limits, own_decode_seqs=decodes, own_prompt_seqs=prompts))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_prefix_splits", [1, 3])
def test_prompt_tiles_without_the_fold_where_no_prompt_row_has_a_prefix(dtype, num_prefix_splits):
    """prompt_prefixes=False, as the engine passes it when its prompt chunks are all alone (the
    shared-prefix jobs' prompt steps: decode members beside lone chunks): the prompt launch is
    compiled for prefix 0 (its key loops from a literal 0, no fold of prefix partials), and the
    values are the reference's. Where a prompt row does have a prefix, that launch reads the
    prefix's keys itself and ignores the prefix pass's partials: still the reference's values,
    summed in another order (in fp32 not the same bits as with the fold: the flag takes effect)."""
    decode_groups = [(32, [(1, 5), (1, 123), (1, 1)]), (64, [(1, 2), (1, 40)])]
    lone = [(1, 40), (11, 11), (20, 57), (0, 7)]            # prompt chunks, fresh and after keys
    args, limits = make_batch(decode_groups, lone, 8, 2, 32, dtype, seed=23)
    decodes, prompts = own_lists(args)
    assert len(prompts) == 2 and not args[6][prompts.long()].any()
    check(args, limits, num_prefix_splits, own_decode_seqs=decodes, own_prompt_seqs=prompts,
          prompt_prefixes=False)

    args, limits = make_batch(MIXED_GROUPS, MIXED_LONE, 8, 2, 32, dtype, seed=17)
    decodes, prompts = own_lists(args)
    members = prompts[args[6][prompts.long()] > 0].long()
    assert len(members) == 4
    rows = torch.cat([torch.arange(int(args[4][b]), int(args[4][b + 1])) for b in members.tolist()])
    got = check(args, limits, num_prefix_splits, own_decode_seqs=decodes, own_prompt_seqs=prompts,
                prompt_prefixes=False)
    folded = check(args, limits, num_prefix_splits, own_decode_seqs=decodes, own_prompt_seqs=prompts)
    if dtype == torch.float32:      # 16-bit outputs may round the two orders' sums alike
        assert not torch.equal(got[rows], folded[rows])
    others = torch.ones(got.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.equal(got[others], folded[others])


def test_own_lists_come_together_and_are_int32():
    args, limits = make_batch(MIXED_GROUPS, MIXED_LONE, 8, 2, 32, torch.float32, seed=17)
    decodes, prompts = own_lists(args)
    with pytest.raises(ValueError, match="come together"):
        run(args, limits, own_decode_seqs=decodes)
    with pytest.raises(ValueError, match="own_prompt_seqs must be a non-empty int32"):
        run(args, limits, own_decode_seqs=decodes, own_prompt_seqs=prompts.long())
    with pytest.raises(ValueError, match="own_decode_seqs must be a non-empty int32"):
        run(args, limits, own_decode_seqs=decodes[:0], own_prompt_seqs=prompts)


@pytest.mark.parametrize("prompt,i32", [(True, False), (False, True), (True, True), (False, False)])
def test_every_key_loop_form_matches_reference(monkeypatch, prompt, i32):
    """Both passes' key loops in each form a tile config may name (scripts/gpu_check_cascade.py
    --sweep times them): PROMPT (block ids a step ahead, K read key by key) and int32 offsets,
    in decode and prompt tiles, with prefix splits."""
    prefix_config, own_config = ca._prefix_config, ca._own_config
    monkeypatch.setattr(ca, "_prefix_config",
                        lambda *a: dataclasses.replace(prefix_config(*a), prompt=prompt, i32=i32))
    monkeypatch.setattr(ca, "_own_config",
                        lambda *a: dataclasses.replace(own_config(*a), prompt=prompt, i32=i32))
    assert ca._prefix_config(4, 4, 32, torch.float16).prompt is prompt
    # Several key steps in a call: a 320-token prefix, own parts up to 200 keys.
    groups = MIXED_GROUPS + [(320, [(1, 200), (6, 150), (1, 70)])]
    args, limits = make_batch(groups, MIXED_LONE + [(1, 210)], 8, 2, 32, torch.float16, seed=5)
    check(args, limits, num_prefix_splits=1)
    check(args, limits, num_prefix_splits=2, own_decode_seqs=own_lists(args)[0],
          own_prompt_seqs=own_lists(args)[1])


@pytest.mark.parametrize("num_prefix_splits", [1, 2, 5])
def test_prefix_splits(num_prefix_splits):
    # 5 splits of a 1-4 block prefix: most splits of most groups hold no key at all.
    args, limits = make_batch(MIXED_GROUPS, MIXED_LONE, 8, 2, 16, torch.float32, seed=num_prefix_splits)
    check(args, limits, num_prefix_splits)


def test_a_long_lone_decode_as_a_group_of_one_is_split():
    # Its 10 full cached blocks as the "prefix", cut in 4 splits; the last 5 tokens in the own pass.
    args, limits = make_batch([(160, [(1, 5)])], [(1, 9)], 8, 2, 32, torch.float16, seed=14)
    check(args, limits, num_prefix_splits=4)


def test_group_rows_span_several_prefix_tiles():
    # fp32 prefix tiles hold 16 rows = 4 positions x 4 heads: 15 rows of one group take 4 tiles,
    # with a prefix longer than one key step (ragged end) and split in 3.
    assert ca._prefix_config(15, 4, 32, torch.float32).block_q == 16
    groups = [(160, [(1, 3), (9, 30), (1, 1), (1, 77), (1, 8), (1, 2), (1, 50)]), (96, [(1, 4), (2, 9)])]
    args, limits = make_batch(groups, [], 8, 2, 32, torch.float32, seed=7)
    assert limits["max_group_rows"] == 15
    check(args, limits, num_prefix_splits=3)


def test_fp16_prefix_tile_of_many_rows():
    # fp16 tiles pack up to 128 rows: 20 decode members x 4 heads = 80 rows -> one 128-row tile.
    groups = [(48, [(1, 1 + i % 7) for i in range(20)]), (16, [(1, 3)] * 3)]
    args, limits = make_batch(groups, [(1, 9)], 8, 2, 16, torch.float16, seed=12)
    assert ca._prefix_config(limits["max_group_rows"], 4, 16, torch.float16).block_q == 128
    check(args, limits)


def test_lone_requests_as_a_prefix_zero_group_and_capacity_padding():
    # Lone requests grouped together with prefix 0 before the real groups; 4 empty groups and
    # generous max sizes, as a CUDA graph captured for a larger step would have.
    args, limits = make_batch(MIXED_GROUPS, MIXED_LONE, 8, 2, 16, torch.float16, seed=21,
                              empty_groups=4, lone_first=True)
    check(args, limits, max_seqlen_q=16, max_group_rows=20, max_prefix_len=512)


def test_only_lone_requests_and_only_padding():
    args, limits = make_batch([], MIXED_LONE, 4, 2, 16, torch.float32, seed=4)
    check(args, limits)
    args, limits = make_batch([], [(0, 5), (0, 9)], 4, 2, 16, torch.float32, seed=5, pad_rows=4)
    got = check(args, limits)
    assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_plain_paged_attention_kernel(dtype):
    """Same batch, same block tables: the plain kernel reads the prefix once per member."""
    args, limits = make_batch(MIXED_GROUPS, MIXED_LONE, 8, 2, 32, dtype, seed=33)
    got = check(args, limits, num_prefix_splits=2)
    q, k_cache, v_cache, table, cu, lens = args[:6]
    plain = pa.paged_attention(q, k_cache, v_cache, table, cu, lens, q.shape[-1] ** -0.5,
                               max_seqlen_q=limits["max_seqlen_q"], max_seqlen_k=int(lens.max()))
    atol, rtol = TOLS[dtype]
    torch.testing.assert_close(got, plain, atol=atol, rtol=rtol)


def test_a_wrong_prefix_block_changes_its_whole_group_and_nothing_else():
    groups = [(32, [(1, 3), (1, 9)]), (32, [(1, 5)])]
    args, limits = make_batch(groups, [(1, 20)], 4, 2, 16, torch.float32, seed=3)
    before = run(args, limits)
    table, v_cache = args[3], args[2]
    v_cache[int(table[0, 1])] += 1.0         # the group's second prefix block
    after = run(args, limits)
    for row in (0, 1):
        assert not torch.allclose(before[row], after[row])
    assert torch.equal(before[2:], after[2:])
    torch.testing.assert_close(after, cascade_attention_ref(*args, 0.25), atol=1e-4, rtol=1.3e-6)


def test_strided_q_and_out():
    args, limits = make_batch(MIXED_GROUPS, MIXED_LONE, 4, 2, 32, torch.float16, seed=8)
    q = args[0]
    fused = torch.randn(q.shape[0], q.shape[1] + 4, q.shape[2], device=q.device).to(q.dtype)
    fused[:, :q.shape[1]] = q
    args = (fused[:, :q.shape[1]],) + args[1:]
    assert not args[0].is_contiguous()
    wide = torch.full((q.shape[0], q.shape[1] + 3, q.shape[2]), float("nan"), dtype=q.dtype, device=q.device)
    got = run(args, limits, out=wide[:, :q.shape[1]])
    torch.testing.assert_close(got, cascade_attention_ref(*args, 32 ** -0.5), atol=1e-2, rtol=1e-3)
    assert wide[:, q.shape[1]:].isnan().all()


def test_reference_is_plain_attention_and_checks_the_group_contract():
    args, _ = make_batch(MIXED_GROUPS, MIXED_LONE, 8, 2, 16, torch.float32, seed=2)
    q, k_cache, v_cache, table, cu, lens, prefix_lens, cu_groups = args
    plain = pa.paged_attention_ref(q, k_cache, v_cache, table, cu, lens, 0.3)
    torch.testing.assert_close(cascade_attention_ref(*args, 0.3), plain, atol=1e-5, rtol=1e-5)

    def bad(match, **change):
        fields = dict(table=table, prefix_lens=prefix_lens, cu_groups=cu_groups) | change
        with pytest.raises(ValueError, match=match):
            cascade_attention_ref(q, k_cache, v_cache, fields["table"], cu, lens, fields["prefix_lens"],
                                  fields["cu_groups"], 0.3)

    def edited(t, index, value):
        t = t.clone()
        t[index] = value
        return t

    bad("multiple of block_size", prefix_lens=edited(prefix_lens, 0, 24))
    bad("does not share", table=edited(table, (1, 0), int(table[0, 0]) + 1))
    bad("does not share", prefix_lens=edited(prefix_lens, 1, 16))
    bad("in no group", prefix_lens=edited(prefix_lens, len(lens) - 3, 16))
    bad("its first query position", prefix_lens=edited(prefix_lens, 4, 64))  # (9, 9): queries at 48..
    bad("must rise", cu_groups=cu_groups.flip(0))


@pytest.mark.parametrize("change,match", [
    (dict(prefix_lens=lambda a: a.long()), "prefix_lens must be int32"),
    (dict(cu_group_seqs=lambda a: a[None]), "cu_group_seqs must be"),
    (dict(prefix_lens=lambda a: a[:-1]), "prefix_lens"),
    (dict(q=lambda a: a.half()), "share one dtype"),
    (dict(block_table=lambda a: a.t().contiguous().t()), "unit stride along blocks"),
])
def test_rejects_bad_inputs(change, match):
    args, limits = make_batch(MIXED_GROUPS, MIXED_LONE, 4, 2, 16, torch.float32, seed=0)
    names = ["q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens", "prefix_lens", "cu_group_seqs"]
    args = [change[n](a) if n in change else a for n, a in zip(names, args)]
    with pytest.raises(ValueError, match=match):
        run(args, limits)


def test_rejects_bad_sizes():
    args, limits = make_batch(MIXED_GROUPS, MIXED_LONE, 4, 2, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="max_group_rows must be >= 1"):
        run(args, limits, max_group_rows=0)
    with pytest.raises(ValueError, match="num_prefix_splits"):
        run(args, limits, num_prefix_splits=0)


def test_choose_num_prefix_splits():
    # 16 groups of 16 decode rows, Llama-8B: 128 prefix programs a split -> 2 splits of a 2000
    # prefix (256 programs, two per SM of 132: one wave; 3 would be 384).
    assert ca.choose_num_prefix_splits(16, 1, 8, 2000) == 2
    assert ca.choose_num_prefix_splits(17, 1, 8, 2000) == 1     # 136 programs: 2 splits, 272
    assert ca.choose_num_prefix_splits(64, 1, 8, 2000) == 1     # 512 programs fill 132 SMs
    assert ca.choose_num_prefix_splits(4, 2, 8, 8000) == 4      # 64 x 4 = 256 programs
    assert ca.choose_num_prefix_splits(1, 1, 8, 300) == 1       # too short to split
    assert ca.choose_num_prefix_splits(1, 1, 1, 10 ** 6) == 16  # capped


def test_prefix_rows_per_tile():
    # Llama-8B in bf16 (4 query heads per kv head): 16 rows fill a 64-row tile, more a 128-row one.
    assert ca.prefix_rows_per_tile(16, 32, 8, 128, torch.bfloat16) == 16
    assert ca.prefix_rows_per_tile(256, 32, 8, 128, torch.bfloat16) == 32
    assert ca.prefix_rows_per_tile(2, 32, 8, 128, torch.bfloat16) == 4
    assert ca.prefix_rows_per_tile(100, 32, 8, 128, torch.float32) == 4    # 16-row fp32 tiles


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs and sync checks need a GPU")
def test_cuda_graph_replay_follows_new_groups():
    """Captured once at fixed capacities; new lengths, prefixes and groups written in place."""
    groups = [(64, [(1, 10), (1, 30), (1, 3)]), (32, [(1, 5), (1, 6)])]
    args, _ = make_batch(groups, [(1, 50)], 8, 2, 64, torch.bfloat16, seed=8, empty_groups=2)
    q, k_cache, v_cache, table, cu, lens, prefix_lens, cu_groups = args
    limits = dict(max_seqlen_q=2, max_group_rows=8, max_prefix_len=128)
    call = lambda: cascade_attention(*args, 0.125, **limits, num_prefix_splits=2)  # noqa: E731
    torch.cuda.set_sync_debug_mode("error")     # any host read of a device value raises
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph, out = capture_graph(call)
    # Next step: every sequence one token longer; the second group dissolves into lone requests.
    lens.add_(1)
    prefix_lens[3:5] = 0
    cu_groups.copy_(torch.tensor([0, 3, 3, 3, 3], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref = cascade_attention_ref(*args, 0.125)
    torch.testing.assert_close(out, ref, atol=1.5e-2, rtol=1e-2)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs and streams need a GPU")
def test_side_by_side_in_a_cuda_graph_gives_the_same_bits():
    """The two passes on two streams, captured (fork and join inside the graph), replayed after
    the step changes in place: the same bits as the passes in turn, run eagerly."""
    groups = [(64, [(1, 10), (1, 30), (1, 3)]), (32, [(1, 5), (1, 6)])]
    args, _ = make_batch(groups, [(1, 50)], 8, 2, 64, torch.bfloat16, seed=8, empty_groups=2)
    q, k_cache, v_cache, table, cu, lens, prefix_lens, cu_groups = args
    limits = dict(max_seqlen_q=2, max_group_rows=8, max_prefix_len=128, num_prefix_splits=2)
    graph, out = capture_graph(lambda: cascade_attention(*args, 0.125, **limits, side_by_side=True))
    lens.add_(1)
    prefix_lens[3:5] = 0
    cu_groups.copy_(torch.tensor([0, 3, 3, 3, 3], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, cascade_attention(*args, 0.125, **limits))


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_writes_a_cascade_step_into_the_buffer_it_is_given(dtype):
    """The engine's Triton backend, as the graphs cut at attention call it
    (engine/piecewise_graphs.py): a cascade step's attention into their output buffer, padded
    past the step's rows; the kernel's values in that very buffer, the padding rows zeroed."""
    from engine.models.attention import AttentionMetadata, triton_backend
    args, limits = make_batch(MIXED_GROUPS, MIXED_LONE, 8, 2, 32, dtype, seed=23)
    q, k_cache, v_cache, table, cu, seq_lens, prefix_lens, cu_groups = args
    decodes, prompts = own_lists(args)
    meta = AttentionMetadata(
        slot_mapping=None, block_table=table, cu_seqlens_q=cu, seq_lens=seq_lens,
        max_seqlen_q=limits["max_seqlen_q"], max_seqlen_k=int(seq_lens.max()),
        prefix_lens=prefix_lens, cu_group_seqs=cu_groups, max_group_rows=limits["max_group_rows"],
        max_prefix_len=limits["max_prefix_len"], num_prefix_splits=2,
        own_decode_seqs=decodes, own_prompt_seqs=prompts)
    assert meta.is_cascade
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    got = triton_backend().paged_attention(q, k_cache, v_cache, meta, q.shape[-1] ** -0.5, None,
                                           out=out)
    assert got is out and not got.isnan().any()
    atol, rtol = TOLS[dtype]                                 # the reference's values
    torch.testing.assert_close(got, cascade_attention_ref(*args, q.shape[-1] ** -0.5),
                               atol=atol, rtol=rtol)
    # and the very bits of the kernel called with the metadata's fields by hand
    want = run(args, limits, 2, own_decode_seqs=decodes, own_prompt_seqs=prompts)
    assert torch.equal(got, want)
    assert not got[-3:].any()                                # the padding rows
