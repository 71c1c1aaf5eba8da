"""The runner's per-step grouping from block tables (engine/cascade_plan.py)."""
import numpy as np
import pytest

from engine.cascade_plan import CascadePlanner
from kernels.cascade_cost import CascadeCostRule

BS = 16
# Every group with a prefix of a block or more and two members is worth it.
EAGER = CascadeCostRule(4, 2, 32, min_prefix_len=0, min_saved_bytes=0, per_group_bytes=0,
                        min_own_programs=1)
LLAMA_8B = CascadeCostRule(32, 8, 128, rows_per_prefix_tile=16, num_prefix_splits=2)


def step(tables, starts, q_lens=None):
    width = max(len(t) for t in tables)
    bt = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    q = np.ones(len(tables), dtype=np.int32) if q_lens is None else np.asarray(q_lens, np.int32)
    return bt, np.asarray(starts, dtype=np.int64), q


def check_plan(plan, bt, starts, q_lens, singles=False):
    """The kernel's contract: members consecutive, one prefix of whole shared blocks, at or
    before every member's first query; everything else prefix 0; a permutation of the rows.
    singles: groups of one (a long lone decode split over its own blocks) allowed."""
    assert sorted(plan.order) == list(range(len(q_lens)))
    cu = plan.cu_group_seqs.tolist()
    assert cu[0] == 0 and all(a < b for a, b in zip(cu, cu[1:]))
    shared_rows = 0
    for g in range(len(cu) - 1):
        rows = plan.order[cu[g]:cu[g + 1]]
        p = int(plan.prefix_lens[cu[g]])
        assert (len(rows) >= 2 or singles) and p > 0 and p % BS == 0
        shared_rows += sum(int(q_lens[r]) for r in rows) if len(rows) >= 2 else 0
        assert (plan.prefix_lens[cu[g]:cu[g + 1]] == p).all()
        for r in rows:
            assert p <= starts[r]
            assert (bt[r, :p // BS] == bt[rows[0], :p // BS]).all()
    assert (plan.prefix_lens[cu[-1]:] == 0).all()
    assert plan.num_cascade_rows == shared_rows


def test_rows_sharing_leading_blocks_form_groups_in_any_order():
    a, b = [1, 2, 3, 4], [9, 8, 7, 6]
    tables = [a + [20], [50, 51], b + [21], a + [22, 23], b + [24], a + [25]]
    starts = [64, 20, 64, 80, 64, 64]
    bt, st, q = step(tables, starts)
    plan = CascadePlanner(BS).plan(bt, st, q, EAGER)
    check_plan(plan, bt, st, q)
    groups = [sorted(plan.order[lo:hi]) for lo, hi in zip(plan.cu_group_seqs[:-1], plan.cu_group_seqs[1:])]
    assert sorted(groups) == [[0, 3, 5], [2, 4]]
    assert plan.order[5] == 1 and plan.max_prefix_len == 64 and plan.num_cascade_rows == 5


def test_the_prefix_stops_before_each_members_first_query():
    shared = list(range(100, 110))
    tables = [shared + [1], shared + [2], shared[:3] + [3, 4]]
    # Row 1 computed 5 blocks before this step, row 0 eight: they share 5; row 2 is still
    # writing its third block (started at 40): it can share only two.
    bt, st, q = step(tables, [130, 80, 40])
    plan = CascadePlanner(BS).plan(bt, st, q, EAGER)
    check_plan(plan, bt, st, q)
    assert plan.prefix_lens.tolist()[:3] in ([80, 80, 0], [32, 32, 32])


def test_a_subset_with_a_longer_shared_run_is_its_own_group_when_that_saves_more():
    sys_prompt, doc = [1, 2], list(range(10, 30))
    tables = [sys_prompt + doc + [40 + i] for i in range(4)] + [sys_prompt + [60 + i] * 5 for i in range(4)]
    starts = [22 * BS] * 4 + [7 * BS] * 4
    bt, st, q = step(tables, starts)
    plan = CascadePlanner(BS).plan(bt, st, q, EAGER)
    check_plan(plan, bt, st, q)
    by_prefix = sorted((int(plan.prefix_lens[lo]), hi - lo) for lo, hi in
                       zip(plan.cu_group_seqs[:-1], plan.cu_group_seqs[1:]))
    # 4 x 22 blocks shared (saves 3 x 22) + 4 x 2 (saves 3 x 2) beats 8 x 2 (saves 7 x 2).
    assert by_prefix == [(2 * BS, 4), (22 * BS, 4)]


def test_prefill_rows_count_their_queries():
    tables = [[1, 2, 3, 4, 5, 6]] * 3
    bt, st, q = step(tables, [64, 64, 64], q_lens=[1, 20, 7])
    plan = CascadePlanner(BS).plan(bt, st, q, EAGER)
    check_plan(plan, bt, st, q)
    assert plan.max_group_rows == 28 and plan.num_cascade_rows == 28


def test_chunks_longer_than_a_prefix_tile_stay_alone():
    tables = [[1, 2, 3, 4, 5, 6]] * 4
    bt, st, q = step(tables, [64] * 4, q_lens=[1, 33, 1, 8])
    rule = CascadeCostRule(4, 2, 32, min_prefix_len=0, min_saved_bytes=0, per_group_bytes=0,
                           rows_per_prefix_tile=32)
    plan = CascadePlanner(BS).plan(bt, st, q, rule)
    check_plan(plan, bt, st, q)
    assert sorted(plan.order[:3]) == [0, 2, 3] and plan.order[3] == 1


def test_long_lone_decodes_split_as_groups_of_one():
    tables = [[1, 2, 3, 4, 5]] * 2 + [list(range(10, 80)), list(range(80, 84)), list(range(90, 160))]
    bt, st, q = step(tables, [70, 70, 1100, 60, 500], q_lens=[1, 1, 1, 1, 4])
    planner = CascadePlanner(BS)
    plan = planner.plan(bt, st, q, EAGER, split_lone_from=1024)
    check_plan(plan, bt, st, q, singles=True)
    assert np.diff(plan.cu_group_seqs).tolist() == [2, 1]
    assert plan.order[2] == 2 and plan.prefix_lens[2] == 1088 and plan.num_cascade_rows == 2
    # No room left in the capacity, or nothing shared: no groups of one.
    plan = planner.plan(bt, st, q, EAGER, split_lone_from=1024, max_groups=1)
    assert np.diff(plan.cu_group_seqs).tolist() == [2]
    bt, st, q = step(tables[2:], [1100, 60, 500], q_lens=[1, 1, 4])
    assert planner.plan(bt, st, q, EAGER, split_lone_from=1024) is None


@pytest.mark.parametrize("own_len,cascade", [(500, True), (2000, False)])
def test_few_rows_with_long_own_parts_stay_plain(own_len, cascade):
    """16 decode rows of one group over a 2000-token prefix (125 blocks): worth it by bytes, but
    16 rows x 8 kv heads are 128 own-pass programs, and an own part of 2000 tokens read by one
    program each runs slower than the plain kernel's split keys (CascadeCostRule.own_pass_fills)."""
    own_blocks = -(-own_len // BS)
    tables = [list(range(1, 126)) + [1000 + own_blocks * i + j for j in range(own_blocks)]
              for i in range(16)]
    bt, st, q = step(tables, [2000 + own_len - 1] * 16)
    plan = CascadePlanner(BS).plan(bt, st, q, LLAMA_8B, max_group_rows=16, max_groups=8)
    assert (plan is not None) == cascade
    # A sequence with no query this step reads nothing: its long context does not count.
    bt2, st2, q2 = step(tables + [list(range(5000, 5200))], [2000 + own_len - 1] * 16 + [3200],
                        [1] * 16 + [0])
    assert (CascadePlanner(BS).plan(bt2, st2, q2, LLAMA_8B, max_group_rows=16, max_groups=8)
            is not None) == cascade
    # With 33 rows (264 programs) the own pass fills the GPU at any own length.
    tables += [list(range(1, 126)) + [9000 + own_blocks * i + j for j in range(own_blocks)]
               for i in range(17)]
    bt, st, q = step(tables, [2000 + own_len - 1] * 33)
    assert CascadePlanner(BS).plan(bt, st, q, LLAMA_8B, max_group_rows=16, max_groups=8) is not None


def test_nothing_shared_or_nothing_worth_it_is_the_plain_kernel():
    planner = CascadePlanner(BS)
    bt, st, q = step([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [40, 40, 40])
    assert planner.plan(bt, st, q, EAGER) is None
    bt, st, q = step([[1, 2, 3], [1, 2, 3]], [0, 40])          # one row still at position 0
    assert planner.plan(bt, st, q, EAGER) is None
    bt, st, q = step([[1, 2, 3], [1, 2, 3]], [40, 40])
    assert planner.plan(bt, st, q, EAGER) is not None
    assert planner.plan(bt, st, q, LLAMA_8B) is None           # 32 tokens: far under the rule


def test_the_8b_rule_on_the_rfc_step():
    # 256 decode rows: 16 groups of 16 over 125 blocks (2000 tokens), 13 own blocks each.
    rng = np.random.default_rng(0)
    prefixes = rng.permutation(100_000)[:16 * 125].reshape(16, 125)
    tables, starts = [], []
    for i in range(256):
        tables.append(prefixes[i % 16].tolist() + (200_000 + 13 * i + np.arange(13)).tolist())
        starts.append(2000 + 190 + i % 16)
    bt, st, q = step(tables, starts)
    plan = CascadePlanner(BS).plan(bt, st, q, LLAMA_8B, max_group_rows=16, max_groups=128)
    check_plan(plan, bt, st, q)
    assert len(plan.cu_group_seqs) == 17 and plan.max_prefix_len == 2000
    assert plan.num_cascade_rows == 256


def test_capacities_split_large_groups_and_keep_the_best():
    tables = [[1, 2, 3, 4, 5, 10 + i] for i in range(40)] + [[7, 8, 20 + i] for i in range(3)]
    starts = [80] * 40 + [32] * 3
    bt, st, q = step(tables, starts)
    planner = CascadePlanner(BS)
    plan = planner.plan(bt, st, q, EAGER, max_group_rows=16)
    check_plan(plan, bt, st, q)
    sizes = np.diff(plan.cu_group_seqs).tolist()
    assert sorted(sizes) == [3, 8, 16, 16]
    plan = planner.plan(bt, st, q, EAGER, max_group_rows=16, max_groups=2)
    check_plan(plan, bt, st, q)
    assert np.diff(plan.cu_group_seqs).tolist() == [16, 16]      # the 80-token ones save more
    # A prefill member over the row limit stays alone; its group goes on without it.
    bt, st, q = step([list(range(1, 12))] * 4, [160] * 4, q_lens=[1, 30, 1, 1])
    plan = planner.plan(bt, st, q, EAGER, max_group_rows=16)
    check_plan(plan, bt, st, q)
    assert sorted(plan.order[:3]) == [0, 2, 3] and plan.order[3] == 1


@pytest.mark.parametrize("seed", range(20))
def test_random_tables_keep_the_contract(seed):
    rng = np.random.default_rng(seed)
    roots = [rng.integers(0, 1000, 12).tolist() for _ in range(4)]
    tables, starts, q_lens = [], [], []
    for _ in range(rng.integers(2, 40)):
        root = roots[rng.integers(0, 4)]
        keep = int(rng.integers(0, 12))
        tables.append(root[:keep] + rng.integers(1000, 5000, int(rng.integers(1, 6))).tolist())
        starts.append(int(rng.integers(0, len(tables[-1]) * BS)))
        q_lens.append(int(rng.choice([1, 1, 1, 5, 30])))
    bt, st, q = step(tables, starts, q_lens)
    plan = CascadePlanner(BS).plan(bt, st, q, EAGER, max_group_rows=int(rng.choice([8, 64])),
                                   split_lone_from=int(rng.choice([64, 10 ** 6])))
    if plan is not None:
        check_plan(plan, bt, st, q, singles=True)
