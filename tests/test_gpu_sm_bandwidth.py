"""scripts/gpu_sm_bandwidth.py's streaming kernel sums each program's own part, once (the timing
itself needs a GPU: its results are in benchmarks/h200/sm_bandwidth.md)."""
import pytest
import torch

from scripts.gpu_sm_bandwidth import COLS, stream_sums


@pytest.mark.parametrize("form", ["ptr", "tma"])
def test_each_program_sums_exactly_its_own_rows(form):
    import triton
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    programs, rows = 3, 16
    x = torch.randint(-8, 9, (programs * rows * 4, COLS), generator=torch.Generator().manual_seed(1)).float()        # small integers: exact sums
    sums, sm = stream_sums(x, programs, form, rows, warps=4, stages=2)
    torch.testing.assert_close(sums, x.view(programs, -1).sum(1), rtol=0, atol=0)
    assert sm.tolist() == [-1] * programs                                 # SM ids only when asked


def test_a_buffer_that_does_not_split_into_whole_tiles_is_refused():
    with pytest.raises(ValueError, match="multiple of programs"):
        stream_sums(torch.zeros(3 * 16 * 4 + 16, COLS), 3, "ptr", 16, warps=4, stages=2)


@pytest.mark.parametrize("paged", [False, True])
def test_the_kv_cache_patterns_sum_each_heads_run_of_tokens(paged):
    from scripts.gpu_sm_bandwidth import PAGE, expected_pattern_sums, pattern_sums
    tokens, heads, programs, rows = 4 * 2 * PAGE, 2, 4, PAGE          # 2 runs of tokens x 2 heads
    gen = torch.Generator().manual_seed(0)       # fixed: this table moves pages between the runs
    x = torch.randint(-8, 9, (tokens, heads, COLS), generator=gen).float()
    table = torch.randperm(tokens // PAGE, generator=gen).to(torch.int32) if paged else None
    got = pattern_sums(x, table, programs, rows, warps=4, stages=2)
    torch.testing.assert_close(got, expected_pattern_sums(x, table, programs), rtol=0, atol=0)
    # by hand: program 3 is head 1 of the second run of tokens
    tok = torch.arange(tokens // 2, tokens)
    phys = table.long()[tok // PAGE] * PAGE + tok % PAGE if paged else tok
    assert got[3].item() == x[phys, 1].sum().item()
    if paged:     # the table matters: read in order, the sums differ
        assert not torch.equal(got, pattern_sums(x, None, programs, rows, warps=4, stages=2))
