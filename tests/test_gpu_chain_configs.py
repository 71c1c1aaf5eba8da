"""scripts/gpu_chain_configs.py's CPU-side logic: the wide candidate set, the ranking of the
configs tried in the step and the tables each trial installs (the GPU runs the rest)."""
from types import SimpleNamespace

from kernels.skinny_gemm import SkinnyConfig
from scripts.gpu_chain_configs import _SMEM_BYTES, _tables, ranked, wide_configs


def test_wide_configs_fit_shared_memory_and_hold_the_chain_picks():
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096)):
        cfgs = wide_configs(n, k, num_sms=132)
        assert len(set(cfgs)) == len(cfgs)
        assert all(c.block_n * c.block_k * 2 * c.num_stages <= _SMEM_BYTES for c in cfgs)
        assert all(c.split_k >= 1 and (c.split_k == 1 or k // c.split_k >= 2 * c.block_k) for c in cfgs)
    # the step's winners on the H200 (benchmarks/h200/chain_configs.md) are among them
    assert SkinnyConfig(64, 128, 3, 4, 4) in wide_configs(4096, 14336, 132)
    assert SkinnyConfig(64, 128, 2, 4, 4) in wide_configs(6144, 4096, 132)


def test_ranked_puts_the_current_first_then_the_fastest_others():
    times = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 0.5}
    assert ranked(times, 2, "a") == ["a", "d", "b"]
    assert ranked(times, 2, "d") == ["d", "b", "c"]
    assert ranked(times, 0, "c") == ["c"]


def test_tables_swap_only_the_one_row_chain_config_of_the_named_projection():
    qkv = [SimpleNamespace(), SimpleNamespace()]
    down = [SimpleNamespace()]
    old, new = SkinnyConfig(32, 256, 2, 4, 3), SkinnyConfig(64, 128, 3, 4, 4)
    base = {id(x): ({1: old}, {}, {1: old, 2: old}) for x in qkv + down}
    tables = _tables(base, {"qkv_proj": qkv, "down_proj": down}, {"down_proj": new})
    assert tables[id(down[0])][2] == {1: new, 2: old} and tables[id(down[0])][0] == {1: old}
    assert all(tables[id(x)][2] == {1: old, 2: old} for x in qkv)
    assert base[id(down[0])][2] == {1: old, 2: old}            # the start-up tables are untouched
