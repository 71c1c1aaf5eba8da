"""kernels/activation.py: the Triton silu_and_mul against silu_and_mul_ref and HF's order.

Without CUDA the kernel runs under Triton's interpreter on CPU (fp32 and fp16; the interpreter
has no bf16), with CUDA on the GPU in bf16 too.
"""
import pytest
import torch
import torch.nn.functional as F

from tests.kernel_support import DEVICE, ON_GPU, load_kernels, require_runnable

activation_module = load_kernels("kernels.activation")
silu_and_mul, silu_and_mul_ref = activation_module.silu_and_mul, activation_module.silu_and_mul_ref


@pytest.fixture(autouse=True)
def kernels_can_run_here():
    require_runnable(activation_module)


DTYPE_TOLS = [(torch.float32, 1e-4, 1.3e-6), (torch.float16, 1e-2, 1e-3)]
if ON_GPU:
    DTYPE_TOLS.append((torch.bfloat16, 1.5e-2, 1e-2))
# (T, I): I = 1500 spans two column blocks with a ragged end
SHAPES = [(1, 64), (5, 341), (123, 1500)] + ([(64, 14336), (1000, 14336)] if ON_GPU else [])
PAD = 3  # NaN columns around strided views
# The inputs hold gate = -100 on purpose: exp(100) overflows to inf in fp32 (silu -> -0).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def make_input(num_tokens, inter_size, dtype, strided, gen, scale=3.0):
    """[T, 2I], gate then up; with `strided`, a column slice of a wider NaN-padded buffer."""
    x = (torch.randn(num_tokens, 2 * inter_size, generator=gen) * scale).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0])  # exp overflow, saturation, zero
    if not strided:
        return x.to(DEVICE)
    buf = torch.full((num_tokens, 2 * inter_size + 2 * PAD), float("nan"), dtype=dtype)
    buf[:, PAD:PAD + 2 * inter_size] = x
    return buf.to(DEVICE)[:, PAD:PAD + 2 * inter_size]


@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS)
@pytest.mark.parametrize("num_tokens,inter_size", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_silu_and_mul_matches_ref(num_tokens, inter_size, dtype, atol, rtol, strided):
    gen = torch.Generator().manual_seed(num_tokens + inter_size)
    x = make_input(num_tokens, inter_size, dtype, strided, gen)
    width = inter_size + 2 * PAD if strided else inter_size
    out_buf = torch.full((num_tokens, width), float("nan"), dtype=dtype, device=DEVICE)
    out = out_buf[:, PAD:PAD + inter_size] if strided else out_buf

    assert silu_and_mul(x, out=out) is out

    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=atol, rtol=rtol)
    if strided:
        assert out_buf[:, :PAD].isnan().all() and out_buf[:, PAD + inter_size:].isnan().all()
    if dtype != torch.float32:
        # HF's order (silu rounded to the dtype before the multiply) is within the same tolerance.
        gate, up = x.chunk(2, dim=-1)
        torch.testing.assert_close(out, F.silu(gate) * up, atol=atol, rtol=rtol)


def test_silu_and_mul_allocates_output():
    gen = torch.Generator().manual_seed(1)
    x = make_input(7, 100, torch.float32, False, gen)
    out = silu_and_mul(x)
    assert out.shape == (7, 100) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=1e-4, rtol=1.3e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ref_is_silu_times_up_in_fp32(dtype):
    """The reference, written from the formula, is torch's silu in fp64 up to one rounding."""
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(9, 64, generator=gen) * 4).to(dtype)
    gate, up = x.double().chunk(2, dim=-1)
    exact = gate * torch.sigmoid(gate) * up
    tols = {torch.float32: (1e-4, 1.3e-6), torch.float16: (1e-2, 1e-3), torch.bfloat16: (1.5e-2, 1e-2)}[dtype]
    torch.testing.assert_close(silu_and_mul_ref(x).double(), exact, atol=tols[0], rtol=tols[1])


def test_silu_and_mul_zero_tokens():
    assert silu_and_mul(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)


def _bad_inputs():
    x = torch.zeros(4, 64, device=DEVICE)
    return {
        "x not 2-D": (dict(x=x[None]), "x must be"),
        "odd columns": (dict(x=x[:, :63]), "even number of columns"),
        "x int": (dict(x=x.long()), "x must be one of"),
        "x column stride": (dict(x=torch.zeros(64, 4, device=DEVICE).t()), "unit column stride"),
        "out shape": (dict(x=x, out=torch.zeros(4, 64, device=DEVICE)), "out must be"),
        "out dtype": (dict(x=x, out=torch.zeros(4, 32, device=DEVICE).half()), "out must be"),
        "out column stride": (dict(x=x, out=torch.zeros(32, 4, device=DEVICE).t()), "out must have unit"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_silu_and_mul_rejects_bad_inputs(case):
    kwargs, message = _bad_inputs()[case]
    with pytest.raises(ValueError, match=message):
        silu_and_mul(**kwargs)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_silu_and_mul_replays_in_cuda_graph():
    gen = torch.Generator().manual_seed(3)
    x = make_input(64, 14336, torch.bfloat16, False, gen)
    silu_and_mul(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = silu_and_mul(x)
    x.copy_(make_input(64, 14336, torch.bfloat16, False, gen))
    graph.replay()
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=1.5e-2, rtol=1e-2)
