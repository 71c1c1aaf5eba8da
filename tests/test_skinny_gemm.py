"""kernels/skinny_gemm.py against fp64 matmul (and torch.matmul's own error in half dtypes), at
odd shapes, every tiling path (masked and whole K steps, split-K merged in the kernel or not),
bias, and the fused SiLU-and-mul prologue (bitwise silu_and_mul followed by the kernel).

Without CUDA the kernel runs under Triton's interpreter on CPU (fp32 and fp16; the interpreter
has no bf16), with CUDA on the GPU in bf16 too.
"""
import pytest
import torch

from kernels.arrival_counters import arrival_counters
from tests.kernel_support import DEVICE, ON_GPU, load_kernels, require_runnable

sg = load_kernels("kernels.skinny_gemm")
activation = load_kernels("kernels.activation")
SkinnyConfig, skinny_gemm, skinny_gemm_ref = sg.SkinnyConfig, sg.skinny_gemm, sg.skinny_gemm_ref


@pytest.fixture(autouse=True)
def kernels_can_run_here():
    require_runnable(sg)
    require_runnable(activation)


DTYPE_TOLS = [(torch.float32, 1e-4, 1.3e-6), (torch.float16, 1e-2, 1e-3)]
if ON_GPU:
    DTYPE_TOLS.append((torch.bfloat16, 1.5e-2, 1e-2))
# (N, K): odd sizes (masked K steps, a partial N tile), whole steps, one row of W
SHAPES = [(5, 123), (341, 200), (96, 256), (1, 64)]
if ON_GPU:
    SHAPES += [(6144, 4096), (4096, 14336)]
CONFIGS = {
    "default": None,
    "split1": SkinnyConfig(64, 64, 1),
    "split3_n16": SkinnyConfig(16, 32, 3),          # K 123: slices 64 + 59 (masked); 200: 96 + 96 + 8
    "split4_n32": SkinnyConfig(32, 16, 4, num_stages=2),
}


def make_inputs(m, n, k, dtype, gen, bias=False, x_cols=None, row_pad=0):
    """x [m, x_cols or k] as a view into rows wider by row_pad (a strided x), W [n, k] scaled so
    that y stays O(1), bias [n]."""
    cols = x_cols or k
    x = torch.randn(m, cols + row_pad, generator=gen).to(dtype)[:, :cols]
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    to = (lambda t: None if t is None else t.to(DEVICE))
    return to(x), to(w), to(b)


def check_accuracy(y, x, w, b, dtype, atol, rtol, silu_mul=False):
    """Within the dtype's pair of the fp64 result, and in half dtypes no worse on average than
    torch's own matmul in that dtype (fp32 accumulation, one rounding, as here)."""
    ref = skinny_gemm_ref(x, w, b, silu_mul=silu_mul)
    assert y.dtype == dtype and y.shape == ref.shape
    torch.testing.assert_close(y.double(), ref, atol=atol, rtol=rtol)
    if dtype != torch.float32 and not silu_mul:
        torch_y = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
        ours, theirs = (y.double() - ref).abs().mean(), (torch_y.double() - ref).abs().mean()
        assert ours <= 1.1 * theirs + 1e-6


@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_matches_matmul(m, n, k, config, dtype, atol, rtol):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = make_inputs(m, n, k, dtype, gen, bias=(n % 2 == 1), row_pad=3 if m > 1 else 0)
    y = skinny_gemm(x, w, b, config=CONFIGS[config])
    check_accuracy(y, x, w, b, dtype, atol, rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS)
@pytest.mark.parametrize("config", ["default", "split3_n16", "split1"])
@pytest.mark.parametrize("m,n,k", [(1, 96, 256), (5, 37, 123)])
def test_silu_mul_prologue_equals_silu_and_mul_then_gemm(m, n, k, config, dtype, atol, rtol):
    gen = torch.Generator().manual_seed(7 * m + n)
    x, w, b = make_inputs(m, n, k, dtype, gen, bias=True, x_cols=2 * k)
    x = x * 3                       # gates well into silu's curve
    y = skinny_gemm(x, w, b, silu_mul=True, config=CONFIGS[config])
    two_step = skinny_gemm(activation.silu_and_mul(x), w, b, config=CONFIGS[config])
    torch.testing.assert_close(y, two_step, atol=0, rtol=0)
    check_accuracy(y, x, w, b, dtype, 4 * atol, rtol, silu_mul=True)   # x 3x larger


@pytest.mark.parametrize("dtype", [d for d, _, _ in DTYPE_TOLS])
@pytest.mark.parametrize("config", ["default", "split1", "split3_n16", "split4_n32"])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_unmerged_partials_add_up_to_the_bits_of_the_merge(config, dtype, silu_mul):
    """merge=False: the K slices' fp32 partials [S, M, N]; added in slice order, the bias added,
    rounded: y's bits (what kernels/rmsnorm.py does with them). No counters are touched."""
    m, n, k = 3, 70, 200
    gen = torch.Generator().manual_seed(31)
    x, w, b = make_inputs(m, n, k, dtype, gen, bias=True, x_cols=2 * k if silu_mul else k)
    cfg = CONFIGS[config] or sg.default_config(n, k)
    parts = skinny_gemm(x, w, silu_mul=silu_mul, config=cfg, merge=False)
    assert parts.shape == (sg.num_k_slices(k, cfg), m, n) and parts.dtype == torch.float32
    acc = torch.zeros(m, n, dtype=torch.float32, device=DEVICE)
    for p in parts:
        acc += p
    want = skinny_gemm(x, w, b, silu_mul=silu_mul, config=cfg)
    torch.testing.assert_close((acc + b.float()).to(dtype), want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="no bias"):
        skinny_gemm(x, w, b, silu_mul=silu_mul, config=cfg, merge=False)


def test_split_k_counters_are_back_at_zero_and_results_repeat():
    """Each split-K call leaves its tile counters at zero, so the next call (or a graph replay)
    finds its last program again: the same inputs give the same bits, new inputs new results."""
    cfg = SkinnyConfig(32, 32, 4)
    gen = torch.Generator().manual_seed(3)
    x, w, b = make_inputs(2, 100, 256, torch.float32, gen)
    first = skinny_gemm(x, w, config=cfg)
    # what the launcher keys them by (cuda:0, not cuda)
    counters = arrival_counters("skinny_gemm", x.device, 0)
    assert counters.count_nonzero() == 0
    assert torch.equal(skinny_gemm(x, w, config=cfg), first)
    x2, _, _ = make_inputs(2, 100, 256, torch.float32, gen)
    check_accuracy(skinny_gemm(x2, w, config=cfg), x2, w, None, torch.float32, 1e-4, 1.3e-6)
    assert counters.count_nonzero() == 0


@pytest.mark.parametrize("config", [SkinnyConfig(32, 32, 1), SkinnyConfig(32, 32, 4)])
def test_out_is_written_and_returned(config):
    """out= (a decode graph's logits buffer): y is written into it, a row stride wider than N
    included, with the bits of the call without it; nothing outside its [M, N] is touched."""
    gen = torch.Generator().manual_seed(5)
    x, w, b = make_inputs(3, 100, 256, torch.float32, gen, bias=True)
    wide = torch.full((3, 104), float("nan"), device=DEVICE)
    got = skinny_gemm(x, w, b, config=config, out=wide[:, :100])
    assert got.data_ptr() == wide.data_ptr() and got.shape == (3, 100)
    assert torch.equal(got, skinny_gemm(x, w, b, config=config))
    assert torch.isnan(wide[:, 100:]).all()


def test_zero_rows_and_zero_k():
    w = torch.zeros(7, 0, device=DEVICE)
    b = torch.arange(7.0, device=DEVICE)
    assert skinny_gemm(torch.zeros(0, 16, device=DEVICE), torch.zeros(7, 16, device=DEVICE)).shape == (0, 7)
    torch.testing.assert_close(skinny_gemm(torch.zeros(2, 0, device=DEVICE), w, b), b.expand(2, 7))


def test_candidate_configs_fill_the_gpu_without_empty_slices():
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096), (5, 123)):
        for cfg in sg.candidate_configs(n, k, num_sms=132):
            tiles = -(-n // cfg.block_n)
            assert cfg.split_k == 1 or k // cfg.split_k >= 2 * cfg.block_k
            assert tiles * cfg.split_k >= min(2 * 132, tiles * max(1, k // (2 * cfg.block_k)))


def test_chain_candidates_add_the_first_tile_at_fewer_slices():
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096)):
        plain = sg.candidate_configs(n, k, num_sms=132)
        chain = sg.chain_candidate_configs(n, k, num_sms=132)
        first = plain[0]
        assert chain[:len(plain)] == plain and len(set(chain)) == len(chain)
        same_tile = {c.split_k for c in chain if (c.block_n, c.block_k, c.num_warps, c.num_stages)
                     == (first.block_n, first.block_k, first.num_warps, first.num_stages)}
        assert set(range(1, first.split_k + 1)) <= same_tile


def _bad_inputs():
    x = torch.zeros(2, 64, device=DEVICE)
    w = torch.zeros(8, 64, device=DEVICE)
    return {
        "x 1-D": (dict(x=x[0], weight=w), "x must be"),
        "17 rows": (dict(x=torch.zeros(17, 64, device=DEVICE), weight=w), "at most 16 rows"),
        "K": (dict(x=x[:, :32], weight=w), "columns"),
        "silu K": (dict(x=x, weight=w, silu_mul=True), "columns"),
        "dtype": (dict(x=x.half(), weight=w), "share one dtype"),
        "w stride": (dict(x=x, weight=torch.zeros(64, 8, device=DEVICE).T), "unit column stride"),
        "bias shape": (dict(x=x, weight=w, bias=torch.zeros(7, device=DEVICE)), "bias must be"),
        "out shape": (dict(x=x, weight=w, out=torch.zeros(2, 7, device=DEVICE)), "out must be"),
        "out dtype": (dict(x=x, weight=w, out=torch.zeros(2, 8, device=DEVICE).half()), "out must be"),
        "out stride": (dict(x=x, weight=w, out=torch.zeros(8, 2, device=DEVICE).T), "out must be"),
        "out unmerged": (dict(x=x, weight=w, out=torch.zeros(2, 8, device=DEVICE), merge=False), "out must be"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_rejects_bad_inputs(case):
    kwargs, message = _bad_inputs()[case]
    with pytest.raises(ValueError, match=message):
        skinny_gemm(**kwargs)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_split_k_replays_in_cuda_graph():
    gen = torch.Generator().manual_seed(9)
    x, w, b = make_inputs(4, 4096, 4096, torch.bfloat16, gen)
    cfg = SkinnyConfig(64, 128, 8)
    skinny_gemm(x, w, config=cfg)                       # compile and allocate outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_gemm(x, w, config=cfg)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=gen).to(x.dtype))
        graph.replay()
        check_accuracy(y, x, w, None, torch.bfloat16, 1.5e-2, 1e-2)
