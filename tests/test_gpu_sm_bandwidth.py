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
    x = torch.randint(-8, 9, (programs * rows * 4, COLS)).float()        # small integers: exact sums
    sums, sm = stream_sums(x, programs, form, rows, warps=4, stages=2)
    torch.testing.assert_close(sums, x.view(programs, -1).sum(1), rtol=0, atol=0)
    assert sm.tolist() == [-1] * programs                                 # SM ids only when asked


def test_a_buffer_that_does_not_split_into_whole_tiles_is_refused():
    with pytest.raises(ValueError, match="multiple of programs"):
        stream_sums(torch.zeros(3 * 16 * 4 + 16, COLS), 3, "ptr", 16, warps=4, stages=2)
