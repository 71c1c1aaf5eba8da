"""scripts/gpu_prompt_backends.py's cases (the timing needs a GPU; its pair count is
gpu_prompt_tiles.causal_pairs_of, tested in tests/test_gpu_prompt_tiles.py)."""
from scripts import gpu_prompt_backends as probe


def test_cases_hold_new_rows_within_their_sequences():
    for name, seqs in probe.CASES:
        assert seqs and all(1 <= q <= n for q, n in seqs), name
