"""The cascade cost rule (kernels/cascade_cost.py): byte counts, plans, and its verdict at every
point measured on the H200 (benchmarks/h200/cascade_attention.txt)."""
import os
import subprocess
import sys

import pytest

from kernels.cascade_cost import CascadeCostRule, PrefixGroup

LLAMA_8B = CascadeCostRule(num_q_heads=32, num_kv_heads=8, head_dim=128, kv_dtype_bytes=2)
MiB = 1 << 20

# H200, Llama-3.1-8B shapes in bf16, 256 decode rows with 200 own tokens each, both kernels from
# CUDA graphs (scripts/gpu_check_cascade.py at 556b582): (group size, prefix_len, prefix splits,
# rows per prefix tile, cascade us, plain us).
H200_TIMINGS = [
    (2, 128, 1, 4, 126.3, 114.1), (2, 496, 1, 4, 178.3, 181.6), (2, 2000, 1, 4, 373.8, 440.4),
    (2, 8000, 1, 4, 1129.4, 1459.6), (4, 128, 1, 4, 114.1, 111.4), (4, 496, 1, 4, 147.4, 174.0),
    (4, 2000, 1, 4, 274.0, 420.6), (4, 8000, 1, 4, 758.5, 1391.9),
    (16, 128, 1, 16, 102.4, 111.0), (16, 496, 1, 16, 113.8, 169.7),
    (16, 2000, 3, 16, 162.5, 409.9), (16, 8000, 3, 16, 284.0, 1349.4),
    (64, 128, 1, 32, 103.1, 109.4), (64, 496, 1, 32, 115.1, 167.9),
    (64, 2000, 5, 32, 167.6, 403.9), (64, 8000, 5, 32, 277.5, 1338.4),
]


@pytest.mark.parametrize("size,prefix_len,splits,rows_per_tile,cascade_us,plain_us", H200_TIMINGS)
def test_rule_picks_the_faster_kernel_at_every_measured_point(size, prefix_len, splits,
                                                              rows_per_tile, cascade_us, plain_us):
    rule = CascadeCostRule(32, 8, 128, num_prefix_splits=splits, rows_per_prefix_tile=rows_per_tile)
    groups = [PrefixGroup(size, prefix_len, size)] * (256 // size)
    assert rule.use_cascade(groups) == (cascade_us < plain_us)


# H200, the same shapes, decode rows in groups at smaller batches and longer own parts (a one-off
# at 38c6fec, benchmarks/h200/cascade_long_own_38c6fec.json): (rows, group size, prefix_len,
# own_len, prefix splits, cascade us, plain us). Bytes alone say cascade at every one of them.
H200_OWN_PARTS = [
    (256, 16, 2000, 200, 2, 128.9, 391.6), (16, 16, 2000, 8000, 7, 328.6, 178.8),
    (8, 8, 4000, 8000, 15, 302.3, 126.5), (32, 16, 2000, 4000, 7, 201.2, 169.1),
    (64, 16, 992, 4000, 3, 272.2, 289.6), (16, 16, 4000, 2000, 15, 112.6, 102.5),
    (64, 16, 2000, 2000, 7, 164.5, 215.2), (128, 16, 2000, 1000, 4, 182.8, 295.0),
    (64, 16, 2000, 500, 7, 71.9, 126.0), (32, 16, 2000, 1000, 7, 74.8, 91.0),
    (16, 16, 2000, 2000, 7, 107.3, 79.0), (16, 16, 2000, 500, 7, 45.9, 53.3),
]


@pytest.mark.parametrize("rows,size,prefix_len,own_len,splits,cascade_us,plain_us", H200_OWN_PARTS)
def test_rule_and_own_pass_pick_the_faster_kernel_at_small_batches(rows, size, prefix_len, own_len,
                                                                   splits, cascade_us, plain_us):
    rule = CascadeCostRule(32, 8, 128, num_prefix_splits=splits, rows_per_prefix_tile=size)
    groups = [PrefixGroup(size, prefix_len, size)] * (rows // size)
    assert rule.use_cascade(groups)
    assert (rule.use_cascade(groups) and rule.own_pass_fills(rows, own_len)) == (cascade_us < plain_us)


# H200, the engine (groups mode, bf16, dummy weights) at dd75bd1: GPU ms of a decode graph step
# with the own-pass check (plain) and without it (cascade), same engine, same call
# (benchmarks/h200/decode_attention_stages.md): (rows, group size, prefix_len, own_len, prefix
# splits as the kernel-level table has them for 2000-token prefixes, cascade ms, plain ms); 200
# tokens out, so own parts grow by up to 200. Bytes say cascade here at every split count from 1
# to 16 and prefix tile of 16-64 rows, so the own-pass check alone decides.
H200_ENGINE_STEPS = [
    (32, 16, 2000, 4000, 7, 10.691, 9.421), (24, 24, 2000, 4000, 7, 10.460, 8.903),
    (32, 16, 2000, 2000, 7, 8.248, 7.692), (16, 16, 2000, 4000, 7, 9.883, 7.484),
]


@pytest.mark.parametrize("rows,size,prefix_len,own_len,splits,cascade_ms,plain_ms", H200_ENGINE_STEPS)
def test_rule_picks_the_faster_engine_step(rows, size, prefix_len, own_len, splits, cascade_ms, plain_ms):
    rule = CascadeCostRule(32, 8, 128, num_prefix_splits=splits, rows_per_prefix_tile=min(size, 16))
    groups = [PrefixGroup(size, prefix_len, size)] * (rows // size)
    assert rule.use_cascade(groups)
    assert (rule.use_cascade(groups) and rule.own_pass_fills(rows, own_len)) == (cascade_ms < plain_ms)


def test_own_pass_fills():
    assert LLAMA_8B.own_pass_fills(33, 10 ** 6)                 # 264 programs: two per SM
    assert not LLAMA_8B.own_pass_fills(32, 1024)
    assert LLAMA_8B.own_pass_fills(32, 1023) and LLAMA_8B.own_pass_fills(1, 0)
    # Decode rows are a tile each, a prompt chunk one per 32 positions, an empty row none.
    assert LLAMA_8B.own_tiles([1] * 20 + [200, 32, 33, 0]) == 20 + 7 + 1 + 2
    with pytest.raises(ValueError, match="min_own_programs"):
        CascadeCostRule(32, 8, 128, min_own_programs=0)


def test_counts_bytes():
    assert LLAMA_8B.kv_bytes_per_token == 2 * 8 * 128 * 2
    # 16 decode members of a 2000-token prefix: 15 of 16 prefix reads saved, minus partials.
    partials = 2 * 1 * 16 * 32 * 130 * 4
    assert LLAMA_8B.saved_bytes(PrefixGroup(16, 2000, 16)) == 15 * 2000 * 4096 - partials
    # 64 members: 64 rows take 2 tiles of 32 rows, so the prefix is read twice.
    assert LLAMA_8B.saved_bytes(PrefixGroup(64, 2000, 64)) == 62 * 2000 * 4096 - 4 * partials
    assert LLAMA_8B.net_bytes(PrefixGroup(16, 2000, 16)) == LLAMA_8B.saved_bytes(
        PrefixGroup(16, 2000, 16)) - MiB


def test_plan():
    big, small = PrefixGroup(16, 2000, 16), PrefixGroup(4, 256, 4)
    assert LLAMA_8B.plan([big] * 16) == [True] * 16
    assert LLAMA_8B.use_cascade([big])
    # Four members sharing 256 tokens save 3 MiB a layer: under the 64 MiB fixed cost, plain.
    assert LLAMA_8B.plan([small]) == [False]
    assert not LLAMA_8B.use_cascade([small] * 20)
    # ...but they ride along with groups that pay for the launch.
    assert LLAMA_8B.plan([big, small]) == [True, True]
    # A pair over 256 tokens saves less than a group's own overhead (1 MiB): it stays plain.
    assert LLAMA_8B.plan([big, PrefixGroup(2, 256, 2)]) == [True, False]
    # Too short a prefix, a group of one, and a group whose rows cost more than its saving.
    assert LLAMA_8B.plan([big, PrefixGroup(16, 112, 16)]) == [True, False]
    assert LLAMA_8B.plan([big, PrefixGroup(1, 4000, 1)]) == [True, False]
    prefill_heavy = PrefixGroup(2, 256, 2000)          # 2 members with 1000-token chunks
    assert LLAMA_8B.saved_bytes(prefill_heavy) < 0
    assert LLAMA_8B.plan([big, prefill_heavy]) == [True, False]
    assert LLAMA_8B.plan([]) == []


def test_parameters():
    eager = CascadeCostRule(32, 8, 128, min_prefix_len=0, min_saved_bytes=0, per_group_bytes=0)
    # One prefix read saved (16 or 32 tokens x 4 KiB) against two rows' partials (2 x 33,280 B).
    assert eager.plan([PrefixGroup(2, 16, 2)]) == [False]
    assert eager.plan([PrefixGroup(2, 32, 2)]) == [True]
    assert eager.plan([PrefixGroup(2, 0, 2)]) == [False]        # no prefix, nothing to share
    fp32 = CascadeCostRule(32, 8, 128, kv_dtype_bytes=4)
    assert fp32.saved_bytes(PrefixGroup(4, 512, 4)) > LLAMA_8B.saved_bytes(PrefixGroup(4, 512, 4))
    split = CascadeCostRule(32, 8, 128, num_prefix_splits=4)
    assert split.saved_bytes(PrefixGroup(4, 512, 4)) < LLAMA_8B.saved_bytes(PrefixGroup(4, 512, 4))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        CascadeCostRule(30, 8, 128)
    with pytest.raises(ValueError, match="head_dim must be >= 1"):
        CascadeCostRule(32, 8, 0)
    with pytest.raises(ValueError, match="per_group_bytes must be >= 0"):
        CascadeCostRule(32, 8, 128, per_group_bytes=-1)


def test_is_torch_free():
    code = ("import sys; import kernels.cascade_cost, engine.scheduler; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0
