"""kernels/exp_noise.py: Philox4x32-10 against Random123's known answers, the kernel against its
eager reference (the same bits; the fp64 log against log1p), the draws' distribution, and a row's
noise depending on its key and stream alone.

Without CUDA the kernel runs under Triton's interpreter on CPU at small blocks, with CUDA on the
GPU at the real block and 256 rows of a 128k vocabulary too.
"""
import math

import pytest
import torch
import triton.language as tl

from tests.kernel_support import DEVICE, ON_GPU, load_kernels, require_runnable

en = load_kernels("kernels.exp_noise")


@pytest.fixture(autouse=True)
def kernels_can_run_here():
    require_runnable(en, triton_functions=(tl.philox,))


@pytest.mark.parametrize("counter,key,want", [
    # Random123's kat_vectors for philox4x32_10.
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_ref_gives_random123s_known_answers(counter, key, want):
    key64 = key[0] | (key[1] << 32)
    key64 = torch.tensor([key64 - (1 << 64) if key64 >> 63 else key64])
    words = en.philox_ref(key64, *(torch.tensor([c]) for c in counter))
    assert tuple(int(w) for w in words) == want


KEYS = [0, 1, -1, 123456789012345, -(1 << 63), (1 << 62) + 12345]
STREAMS = [0, 1, 7, -1, 2 ** 31 - 1, 300]
SHAPES = [(6, 37, 16), (6, 1000, 256), (6, 4096, 512)]      # (rows, V, block)
if ON_GPU:
    SHAPES += [(6, 128256, en.BLOCK)]


@pytest.mark.parametrize("rows,vocab,block", SHAPES)
def test_kernel_equals_the_reference(rows, vocab, block):
    keys = torch.tensor(KEYS[:rows], device=DEVICE)
    streams = torch.tensor(STREAMS[:rows], dtype=torch.int32, device=DEVICE)
    got = en.exponential_noise(keys, streams, vocab, block=block)
    want = en.exponential_noise_ref(keys, streams, vocab)
    assert got.shape == (rows, vocab) and got.dtype == torch.float32
    # The same bits; the kernel's fp64 log of the exact 1 - u against log1p, each rounded to fp32.
    torch.testing.assert_close(got, want, rtol=1.3e-7, atol=0)


def test_draws_are_exp1():
    """64 x 4,096 draws: mean and variance 1 (4,096-draw rows' means too), P(q < ln 2) = 1/2,
    P(q < 0.01) = 1 - e^-0.01, all > 0 and finite. Bounds are ~5 standard errors; the draws are
    keyed, so the outcome is fixed."""
    n = 64 * 4096
    q = en.exponential_noise(torch.arange(64, device=DEVICE) * 7919, torch.arange(64, dtype=torch.int32,
                                                                                 device=DEVICE), 4096).double().cpu()
    assert torch.isfinite(q).all() and (q > 0).all()
    assert abs(q.mean().item() - 1) < 5 / math.sqrt(n)
    assert abs(q.var().item() - 1) < 5 * math.sqrt(8 / n)
    assert abs((q < math.log(2)).double().mean().item() - 0.5) < 5 * 0.5 / math.sqrt(n)
    p = 1 - math.exp(-0.01)
    assert abs((q < 0.01).double().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)
    assert (q.mean(1) - 1).abs().max().item() < 5 / math.sqrt(4096)


def test_a_rows_noise_is_its_key_and_stream_alone():
    keys = torch.tensor([5, 5, 9, 5], device=DEVICE)
    streams = torch.tensor([0, 1, 0, 0], dtype=torch.int32, device=DEVICE)
    batch = en.exponential_noise(keys, streams, 300, block=64)
    alone = en.exponential_noise(keys[:1], streams[:1], 300, block=128)
    assert torch.equal(batch[0], alone[0]) and torch.equal(batch[3], alone[0])
    assert not torch.equal(batch[0], batch[1]) and not torch.equal(batch[0], batch[2])


def test_rejects_what_it_does_not_take():
    keys = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    streams = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="keys must be"):
        en.exponential_noise(keys.int(), streams, 8)
    with pytest.raises(ValueError, match="streams must be"):
        en.exponential_noise(keys, streams.long(), 8)
    with pytest.raises(ValueError, match="num_cols"):
        en.exponential_noise(keys, streams, 0)
    # Views with a row stride (a column of a [B, 2] table) were read as if contiguous.
    table = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="keys and streams must be contiguous"):
        en.exponential_noise(table[:, 0], streams, 8)
    with pytest.raises(ValueError, match="keys and streams must be contiguous"):
        en.exponential_noise(keys, table.int()[:, 1], 8)


def test_a_counter_gives_four_columns():
    """Key 0, stream 0: columns 0-3 are the four words of counter (0, 0, 0, 0), Random123's first
    known answer, through u = (x + 1/2) 2^-31 and q = -log(1 - u)."""
    words = (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    want = [-math.log1p(-((w >> 1) + 0.5) * 2.0 ** -31) for w in words]
    got = en.exponential_noise(torch.zeros(1, dtype=torch.int64, device=DEVICE),
                               torch.zeros(1, dtype=torch.int32, device=DEVICE), 6, block=16)
    torch.testing.assert_close(got[0, :4].cpu().double(), torch.tensor(want, dtype=torch.float64),
                               rtol=1.3e-7, atol=0)
