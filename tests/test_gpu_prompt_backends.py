"""scripts/gpu_prompt_backends.py's cases and pair count (the timing needs a GPU)."""
from scripts import gpu_prompt_backends as probe


def test_causal_pairs_count_each_rows_visible_keys():
    assert probe.causal_pairs([(3, 3)]) == 1 + 2 + 3
    assert probe.causal_pairs([(2, 5)]) == 4 + 5           # the last two of five positions
    assert probe.causal_pairs([(1, 4), (2, 2)]) == 4 + 1 + 2


def test_cases_hold_new_rows_within_their_sequences():
    for name, seqs in probe.CASES:
        assert seqs and all(1 <= q <= n for q, n in seqs), name
