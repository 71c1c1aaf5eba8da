"""kernels/argmax.py against torch.argmax: the same index for every row, ties (first occurrence,
within a chunk and across chunks), -inf masks, whole rows of -inf, NaN, strided rows, every
input dtype.

Without CUDA the kernels run under Triton's interpreter on CPU (fp32 and fp16; the interpreter
has no bf16) at small chunk sizes, with CUDA on the GPU at the real one and a 128k vocabulary.
"""
import pytest
import torch

from tests.kernel_support import DEVICE, ON_GPU, load_kernels, require_runnable

am = load_kernels("kernels.argmax")


@pytest.fixture(autouse=True)
def kernels_can_run_here():
    require_runnable(am)


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# (rows, V, chunk): one partial chunk, several with a ragged end, one column, an exact fit
SHAPES = [(3, 37, 64), (5, 1000, 128), (2, 1, 16), (4, 512, 128)]
if ON_GPU:
    SHAPES += [(1, 128256, am.CHUNK), (256, 128256, am.CHUNK), (16, 151936, am.CHUNK)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab,chunk", SHAPES)
def test_equals_torch_argmax(rows, vocab, chunk, dtype):
    gen = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=gen).to(dtype).to(DEVICE)
    got = am.argmax_rows(x, chunk=chunk)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, x.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_masks_and_nan_follow_torch(dtype):
    """Ties give the first index, in one chunk and across chunks; -inf masks (min_tokens) are
    never picked over a number; a row of -inf gives 0; NaN is the largest."""
    vocab, chunk = 300, 64
    x = torch.zeros(7, vocab, dtype=dtype)
    x[0, [5, 9, 250]] = 3.0                     # ties in chunk 0 and chunk 3: 5
    x[1, [70, 200, 299]] = 2.0                  # first in chunk 1
    x[2] = float("-inf")
    x[2, 299] = -1e4                            # the only number: the last column
    x[3] = float("-inf")                        # all masked: 0, as torch
    x[4, 131] = float("nan")
    x[4, 10] = 5.0                              # NaN wins
    x[5] = -2.0
    x[5, 64:128] = float("-inf")                # a masked chunk between equal values: 0
    x[6, 299] = 1.0                             # the ragged last chunk
    x = x.to(DEVICE)
    got = am.argmax_rows(x, chunk=chunk)
    assert got.tolist() == [5, 70, 299, 0, 131, 0, 299]
    assert torch.equal(got, x.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_beats_inf_wherever_it_lies(dtype):
    """torch.argmax takes NaN over +inf: the first NaN, before or after an +inf, in its chunk or
    another (NaN once read as +inf gave the first of them)."""
    inf, nan = float("inf"), float("nan")
    x = torch.zeros(4, 40, dtype=dtype)
    x[0, [0, 1]] = torch.tensor([inf, nan], dtype=dtype)     # one chunk, +inf first
    x[1, [3, 30]] = torch.tensor([inf, nan], dtype=dtype)    # the NaN in a later chunk
    x[2, [5, 33]] = torch.tensor([nan, inf], dtype=dtype)    # the NaN first
    x[3, [20, 35]] = torch.tensor([nan, nan], dtype=dtype)   # two NaN chunks: the first NaN
    x = x.to(DEVICE)
    got = am.argmax_rows(x, chunk=16)
    assert got.tolist() == [1, 30, 5, 20]
    assert torch.equal(got, x.argmax(-1))


def test_strided_rows_and_no_rows():
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(6, 260, generator=gen).to(DEVICE)
    x = wide[::2, 3:203]                        # row stride 520, unit column stride
    assert torch.equal(am.argmax_rows(x, chunk=32), x.argmax(-1))
    assert am.argmax_rows(torch.zeros(0, 50, device=DEVICE), chunk=32).shape == (0,)


@pytest.mark.parametrize("case,message", [
    (lambda: am.argmax_rows(torch.zeros(5, device=DEVICE)), "must be \\[B, V\\]"),
    (lambda: am.argmax_rows(torch.zeros(2, 5, dtype=torch.int64, device=DEVICE)), "must be one of"),
    (lambda: am.argmax_rows(torch.zeros(2, 0, device=DEVICE)), "at least one column"),
    (lambda: am.argmax_rows(torch.zeros(5, 2, device=DEVICE).T), "unit column stride"),
    (lambda: am.argmax_rows(torch.zeros(2, 5, device=DEVICE), chunk=48), "power of two"),
])
def test_rejects_bad_inputs(case, message):
    with pytest.raises(ValueError, match=message):
        case()
