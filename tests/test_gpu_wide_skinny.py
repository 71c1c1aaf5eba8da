"""scripts/gpu_wide_skinny.py's configs, and the skinny GEMM's kernel at the wider BLOCK_M it
calls it with (the timing needs a GPU)."""
import pytest
import torch
import triton

import kernels.skinny_gemm as sg
from kernels.arrival_counters import arrival_counters
from scripts import gpu_wide_skinny as probe


@pytest.mark.parametrize("rows, expected", [(1, 16), (16, 16), (17, 32), (32, 32), (100, 128), (256, 256)])
def test_block_m_is_the_next_power_of_two_from_16(rows, expected):
    assert probe.block_m(rows) == expected


def test_configs_hold_no_repeats_and_the_kernels_split_counts():
    cfgs = probe.configs(4096, 4096, 132, ((64, 64, 4, 4), (64, 64, 4, 4), (256, 64, 8, 4)))
    assert len(cfgs) == len(set(cfgs)) == 6
    assert {c[:4] for c in cfgs} == {(64, 64, 4, 4), (256, 64, 8, 4)}
    assert [c[4] for c in cfgs if c[0] == 64] == [3, 5, 9]     # 1, 2, 4 programs an SM over 64 tiles


@pytest.mark.parametrize("rows, n, k, block_n, block_k, split", [
    (20, 96, 256, 64, 64, 2), (64, 128, 128, 64, 32, 1), (33, 64, 512, 32, 64, 4)])
def test_the_kernel_at_a_wider_block_m_matches_x_at_w(rows, n, k, block_n, block_k, split):
    """The launch the probe makes, merged, on CPU tensors under the interpreter."""
    torch.manual_seed(0)
    x, w = torch.randn(rows, k), torch.randn(n, k)
    y = torch.empty(rows, n)
    bm = probe.block_m(rows)
    per, slices = sg._k_slices(k, sg.SkinnyConfig(block_n, block_k, split))
    tiles = triton.cdiv(n, block_n)
    part = torch.empty(slices, tiles * block_n, bm)
    counters = arrival_counters("test_wide_skinny", torch.device("cpu"), tiles)
    sg._skinny_gemm_kernel[(tiles, slices)](
        x, w, w, y, part, counters, rows, n, k, per, slices, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=False, SILU_MUL=False, HAS_SPLITS=slices > 1, EVEN_K=k % block_k == 0, BLOCK_M=bm,
        BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION="ieee", USE_PDL=False, SPLIT_OUT=False)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-4)
    assert int(counters.sum()) == 0         # every tile's counter back at zero after the merge
