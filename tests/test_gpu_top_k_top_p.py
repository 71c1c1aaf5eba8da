"""scripts/gpu_top_k_top_p.py's cases and configs (the timing needs a GPU; the kernel's
correctness is tests/test_top_k_top_p.py's)."""
from scripts import gpu_top_k_top_p as probe


def test_cases_cover_each_cut_and_configs_are_distinct():
    assert {(k > 0, p < 1.0) for k, p in probe.CASES.values()} == {(False, True), (True, True), (True, False)}
    assert len(set(probe.CONFIGS)) == len(probe.CONFIGS)
    assert all(block & (block - 1) == 0 and warps in (4, 8, 16) for block, warps in probe.CONFIGS)
