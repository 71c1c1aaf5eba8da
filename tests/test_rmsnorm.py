"""kernels/rmsnorm.py: the Triton kernel against rms_norm_ref, and rms_norm_ref against HF.

Without CUDA the kernel runs under Triton's interpreter on CPU (fp32 and fp16; the interpreter
has no bf16), with CUDA on the GPU in bf16 too.
"""
import pytest
import torch
import triton.language as tl

from tests.kernel_support import DEVICE, ON_GPU, load_kernels, require_runnable

rmsnorm_module = load_kernels("kernels.rmsnorm")
rms_norm, rms_norm_ref = rmsnorm_module.rms_norm, rmsnorm_module.rms_norm_ref
DTYPES_FOR_PARTS = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])


@pytest.fixture(autouse=True)
def kernels_can_run_here():
    require_runnable(rmsnorm_module, triton_functions=(tl.sum,))


DTYPE_TOLS = [(torch.float32, 1e-4, 1.3e-6), (torch.float16, 1e-2, 1e-3)]
if ON_GPU:
    DTYPE_TOLS.append((torch.bfloat16, 1.5e-2, 1e-2))
SHAPES = [(1, 341), (5, 64), (123, 341)] + ([(64, 4096), (257, 8192)] if ON_GPU else [])
EPS = 1e-5
PAD = 7  # extra columns around strided views, poisoned with NaN


def make_rows(num_tokens, hidden_size, dtype, strided, gen, scale=2.0):
    """[T, H] of N(0, scale^2); with `strided`, a column slice of a wider NaN-padded buffer."""
    x = (torch.randn(num_tokens, hidden_size, generator=gen) * scale).to(dtype)
    if not strided:
        return x.to(DEVICE)
    buf = torch.full((num_tokens, hidden_size + 2 * PAD), float("nan"), dtype=dtype)
    buf[:, PAD:PAD + hidden_size] = x
    return buf.to(DEVICE)[:, PAD:PAD + hidden_size]


def poisoned_out(num_tokens, hidden_size, dtype, strided):
    """A NaN-filled output; with `strided`, a column slice of a NaN buffer (returned too)."""
    width = hidden_size + 2 * PAD if strided else hidden_size
    buf = torch.full((num_tokens, width), float("nan"), dtype=dtype, device=DEVICE)
    return (buf[:, PAD:PAD + hidden_size] if strided else buf), buf


@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS)
@pytest.mark.parametrize("num_tokens,hidden_size", SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "strided+residual"])
def test_rms_norm_matches_ref(num_tokens, hidden_size, dtype, atol, rtol, layout):
    # contiguous + residual: test_rms_norm_allocates_outputs_and_runs_in_place
    strided, with_residual = layout.startswith("strided"), layout.endswith("residual")
    gen = torch.Generator().manual_seed(num_tokens * 1000 + hidden_size)
    x = make_rows(num_tokens, hidden_size, dtype, strided, gen)
    residual = make_rows(num_tokens, hidden_size, dtype, strided, gen) if with_residual else None
    weight = (1 + 0.2 * torch.randn(hidden_size, generator=gen)).to(dtype).to(DEVICE)
    out, out_buf = poisoned_out(num_tokens, hidden_size, dtype, strided)
    res_out, res_buf = poisoned_out(num_tokens, hidden_size, dtype, strided) if with_residual else (None, None)
    x_before = x.clone()

    result = rms_norm(x, weight, EPS, residual, out=out, residual_out=res_out)

    expected = rms_norm_ref(x_before, weight, EPS, residual)
    if with_residual:
        assert result[0] is out and result[1] is res_out
        # The new residual is one rounded add, the same in both: it must match exactly.
        torch.testing.assert_close(res_out, expected[1], atol=0, rtol=0)
        expected = expected[0]
    else:
        assert result is out
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(x, x_before, atol=0, rtol=0, equal_nan=True)
    if strided:  # nothing written outside the views
        for buf in (out_buf, res_buf) if with_residual else (out_buf,):
            assert buf[:, :PAD].isnan().all() and buf[:, PAD + hidden_size:].isnan().all()


@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS)
def test_rms_norm_allocates_outputs_and_runs_in_place(dtype, atol, rtol):
    gen = torch.Generator().manual_seed(1)
    x = make_rows(17, 96, dtype, False, gen)
    residual = make_rows(17, 96, dtype, False, gen)
    weight = (1 + 0.2 * torch.randn(96, generator=gen)).to(dtype).to(DEVICE)
    expected, expected_residual = rms_norm_ref(x, weight, EPS, residual)

    out, new_residual = rms_norm(x, weight, EPS, residual)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    assert new_residual.data_ptr() not in (x.data_ptr(), residual.data_ptr())

    out, new_residual = rms_norm(x, weight, EPS, residual, out=x, residual_out=residual)
    assert out is x and new_residual is residual
    torch.testing.assert_close(x, expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)


def test_rms_norm_promotes_like_hf_with_fp32_weight():
    """HF multiplies an fp32 weight by the fp16-rounded normalized row: the result is fp32, but
    only as precise as that fp16 rounding (which a reordered sum may flip), hence fp16 tolerances."""
    gen = torch.Generator().manual_seed(2)
    x = make_rows(5, 64, torch.float16, False, gen)
    weight = (1 + 0.2 * torch.randn(64, generator=gen)).to(DEVICE)
    out = rms_norm(x, weight, EPS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, rms_norm_ref(x, weight, EPS), atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ref_matches_hf_llama_rmsnorm(dtype):
    """rms_norm_ref is bitwise HF's LlamaRMSNorm, and HF's decoder-layer residual add before it."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(3)
    hidden = (torch.randn(9, 200, generator=gen) * 3).to(dtype)
    residual = (torch.randn(9, 200, generator=gen) * 3).to(dtype)
    hf = LlamaRMSNorm(200, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.2 * torch.randn(200, generator=gen))
        torch.testing.assert_close(rms_norm_ref(hidden, hf.weight, EPS), hf(hidden), atol=0, rtol=0)
        out, new_residual = rms_norm_ref(hidden, hf.weight, EPS, residual)
        torch.testing.assert_close(new_residual, residual + hidden, atol=0, rtol=0)
        torch.testing.assert_close(out, hf(residual + hidden), atol=0, rtol=0)


def test_rms_norm_zero_tokens():
    x = torch.empty(0, 64, device=DEVICE)
    out, new_residual = rms_norm(x, torch.ones(64, device=DEVICE), EPS, torch.empty(0, 64, device=DEVICE))
    assert out.shape == (0, 64) and new_residual.shape == (0, 64)


def _bad_inputs():
    x = torch.zeros(4, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    return {
        "x not 2-D": (dict(x=x[None], weight=w), "x must be"),
        "x int": (dict(x=x.long(), weight=w), "x must be one of"),
        "x column stride": (dict(x=torch.zeros(64, 4, device=DEVICE).t(), weight=w), "unit column stride"),
        "weight shape": (dict(x=x, weight=w[:32]), "weight must be"),
        "weight strided": (dict(x=x, weight=torch.ones(128, device=DEVICE)[::2]), "weight must be contiguous"),
        "residual dtype": (dict(x=x, weight=w, residual=x.half()), "residual must be"),
        "residual shape": (dict(x=x, weight=w, residual=x[:3]), "residual must be"),
        "out dtype": (dict(x=x, weight=w, out=x.half()), "out must be"),
        "residual_out alone": (dict(x=x, weight=w, residual_out=x.clone()), "residual_out is given"),
        "negative eps": (dict(x=x, weight=w, eps=-1.0), "eps must be"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_rms_norm_rejects_bad_inputs(case):
    kwargs, message = _bad_inputs()[case]
    kwargs.setdefault("eps", EPS)
    with pytest.raises(ValueError, match=message):
        rms_norm(**kwargs)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_rms_norm_replays_in_cuda_graph():
    gen = torch.Generator().manual_seed(4)
    x = make_rows(64, 4096, torch.bfloat16, False, gen)
    residual = make_rows(64, 4096, torch.bfloat16, False, gen)
    weight = (1 + 0.2 * torch.randn(4096, generator=gen)).to(torch.bfloat16).to(DEVICE)
    rms_norm(x, weight, EPS, residual)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, new_residual = rms_norm(x, weight, EPS, residual)
    x.copy_(make_rows(64, 4096, torch.bfloat16, False, gen))
    residual.copy_(make_rows(64, 4096, torch.bfloat16, False, gen))
    graph.replay()
    expected, expected_residual = rms_norm_ref(x, weight, EPS, residual)
    torch.testing.assert_close(out, expected, atol=1.5e-2, rtol=1e-2)
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES_FOR_PARTS)
@pytest.mark.parametrize("num_parts,bias", [(1, False), (3, True), (4, False)])
def test_x_from_gemm_partials_gives_the_bits_of_the_merged_x(dtype, num_parts, bias):
    """x_parts (a skinny GEMM's unmerged K slices): x = their sum in order (+ x_bias), rounded to
    the residual's dtype, then the norm as usual: the same bits as merging first."""
    gen = torch.Generator().manual_seed(num_parts)
    t, h = 3, 200
    parts = torch.randn(num_parts, t, h, generator=gen).to(DEVICE)
    b = torch.randn(h, generator=gen).to(dtype).to(DEVICE) if bias else None
    res = torch.randn(t, h, generator=gen).to(dtype).to(DEVICE)
    w = (1 + torch.randn(h, generator=gen) / 4).to(dtype).to(DEVICE)
    acc = torch.zeros(t, h, device=DEVICE)
    for p in parts:
        acc += p
    x = (acc + (b.float() if bias else 0)).to(dtype)
    want_out, want_res = rms_norm(x, w, 1e-6, res.clone())
    got_out, got_res = rms_norm(None, w, 1e-6, res.clone(), x_parts=parts, x_bias=b)
    assert torch.equal(got_out, want_out) and torch.equal(got_res, want_res)


def test_x_parts_bad_forms_are_named():
    res = torch.zeros(2, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    parts = torch.zeros(2, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="x or x_parts, not both"):
        rms_norm(res, w, 1e-6, res, x_parts=parts)
    with pytest.raises(ValueError, match="needs the residual"):
        rms_norm(None, w, 1e-6, x_parts=parts)
    with pytest.raises(ValueError, match=r"x_parts must be float32 \[S >= 1, T, H\] = \[S, 2, 8\]"):
        rms_norm(None, w, 1e-6, res, x_parts=torch.zeros(2, 2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="x_bias must be"):
        rms_norm(None, w, 1e-6, res, x_parts=parts, x_bias=torch.zeros(7, device=DEVICE))
    with pytest.raises(ValueError, match="x_bias is given but x_parts is None"):
        rms_norm(res, w, 1e-6, res, x_bias=torch.zeros(8, device=DEVICE))
