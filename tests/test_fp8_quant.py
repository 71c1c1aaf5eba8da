"""kernels/fp8_quant.py: the Triton per-row FP8 quantization against quantize_rows_ref (the same
bits), the reference against the math (every value within half an FP8 step of its input), the
fused SiLU-and-mul + quantization against the two kernels one after the other (the same bits)
and its reference, and on a GPU torch._scaled_mm against fp8_matmul_ref.

Without CUDA the kernel runs under Triton's interpreter on CPU (fp32 and fp16), with CUDA on the
GPU in bf16 too.
"""
import pytest
import torch
import triton.language as tl

from tests.kernel_support import DEVICE, ON_GPU, load_kernels, require_runnable

fq = load_kernels("kernels.fp8_quant")
act = load_kernels("kernels.activation")

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# (M, K): odd widths, one past a power of two, and the 8B model's inputs on the GPU
SHAPES = [(1, 64), (5, 123), (7, 1025)] + ([(64, 4096), (300, 14336)] if ON_GPU else [(2, 4096)])


@pytest.fixture(autouse=True)
def kernels_can_run_here():
    require_runnable(fq, triton_functions=(tl.max,))


def make_input(m, k, dtype, strided, gen):
    x = torch.randn(m, k, generator=gen) * 3
    x[0] = 0.0                                  # an all-zero row: scale at its floor, q all zero
    if m > 2:
        x[1, :3] = torch.tensor([1e4, -1e-6, 0.5])    # one huge value sets the row's scale
    x = x.to(dtype)
    if not strided:
        return x.to(DEVICE)
    buf = torch.full((m, k + 8), float("nan"), dtype=dtype)
    buf[:, 3:3 + k] = x
    return buf.to(DEVICE)[:, 3:3 + k]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_quantize_rows_equals_ref(m, k, dtype, strided):
    x = make_input(m, k, dtype, strided, torch.Generator().manual_seed(m * 1000 + k))
    q, scale = fq.quantize_rows(x)
    q_ref, scale_ref = fq.quantize_rows_ref(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, k) and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (m, 1)
    torch.testing.assert_close(scale, scale_ref, atol=0, rtol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_ref_within_half_a_step(dtype):
    """e4m3's largest step is 32 (between 256 and 448), so |q * scale - x| <= 16 * scale, and each
    row's largest |x| maps to exactly 448."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 777, generator=gen) * torch.logspace(-3, 3, 9)[:, None]).to(dtype)
    q, scale = fq.quantize_rows_ref(x)
    xf = x.float()
    err = (q.float() * scale - xf).abs()
    assert (err <= 16 * scale * (1 + 1e-6)).all(), (err / scale).max()     # fp32 rounding of the product
    top = xf.abs().argmax(dim=1)
    assert (q.float().gather(1, top[:, None]).abs() == 448).all()
    torch.testing.assert_close(scale[:, 0], xf.abs().amax(dim=1) / 448, atol=0, rtol=1e-6)


def test_quantize_rows_rejects_bad_input():
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        fq.quantize_rows(torch.zeros(2, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="x must be one of"):
        fq.quantize_rows(torch.zeros(2, 3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="unit column stride"):
        fq.quantize_rows(torch.zeros(4, 6, device=DEVICE)[:, ::2])


def test_quantize_rows_no_rows():
    q, scale = fq.quantize_rows(torch.zeros(0, 64, device=DEVICE))
    assert q.shape == (0, 64) and scale.shape == (0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,inter", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_silu_mul_quantize_rows_is_the_two_kernels(m, inter, dtype, strided):
    """The same bits as silu_and_mul's kernel then quantize_rows' (down_proj's input on the FP8
    path), and within one FP8 step of the reference (the references' exp is torch's, the
    kernels' the device's or numpy's: the product may round apart by an ulp of x's dtype)."""
    x = make_input(m, 2 * inter, dtype, strided, torch.Generator().manual_seed(m * 1000 + inter + 1))
    q, scale = fq.silu_mul_quantize_rows(x)
    q_two, scale_two = fq.quantize_rows(act.silu_and_mul(x))
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, inter) and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (m, 1)
    torch.testing.assert_close(scale, scale_two, atol=0, rtol=0)
    assert torch.equal(q.view(torch.uint8), q_two.view(torch.uint8))
    q_ref, scale_ref = fq.silu_mul_quantize_rows_ref(x.cpu())
    torch.testing.assert_close(scale.cpu(), scale_ref, atol=0, rtol=1e-2)
    err = (q.cpu().float() * scale.cpu() - q_ref.float() * scale_ref).abs()
    assert (err <= 32 * scale_ref * 1.02).all(), (err / scale_ref).max()     # e4m3's largest step


def test_silu_mul_quantize_rows_rejects_bad_input():
    with pytest.raises(ValueError, match=r"x must be \[M, 2I\]"):
        fq.silu_mul_quantize_rows(torch.zeros(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match=r"x must be \[M, 2I\]"):
        fq.silu_mul_quantize_rows(torch.zeros(2, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="x must be one of"):
        fq.silu_mul_quantize_rows(torch.zeros(2, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="unit column stride"):
        fq.silu_mul_quantize_rows(torch.zeros(4, 8, device=DEVICE)[:, ::2])
    q, scale = fq.silu_mul_quantize_rows(torch.zeros(0, 64, device=DEVICE))
    assert q.shape == (0, 32) and scale.shape == (0, 1)


@pytest.mark.skipif(not ON_GPU, reason="torch._scaled_mm's row-wise FP8 GEMM needs a GPU")
@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (37, 4096, 14336), (512, 28672, 4096)])
def test_scaled_mm_matches_fp8_matmul_ref(m, n, k):
    from engine.models.fp8_linear import quantize_weight
    gen = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w8, w_scale = quantize_weight(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    q, scale = fq.quantize_rows(x)
    got = torch._scaled_mm(q, w8.t(), scale_a=scale, scale_b=w_scale.t(), out_dtype=torch.bfloat16)
    want = fq.fp8_matmul_ref(q, scale, w8, w_scale)
    torch.testing.assert_close(got.float(), want, atol=1.5e-2 * want.abs().max().item(), rtol=1e-2)
