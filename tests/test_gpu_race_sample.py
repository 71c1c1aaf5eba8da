"""scripts/gpu_race_sample.py's cases and configs (the timing needs a GPU; the kernel's
correctness is tests/test_race_sample.py's)."""
from scripts import gpu_race_sample as probe


def test_cases_cover_each_cut_and_configs_are_distinct():
    assert {(k > 0, p < 1.0) for k, p, _ in probe.CASES.values()} == {
        (False, False), (False, True), (True, True), (True, False)}
    assert len(set(probe.CONFIGS)) == len(probe.CONFIGS)
    assert all(block & (block - 1) == 0 and warps in (4, 8, 16) for block, warps in probe.CONFIGS)
