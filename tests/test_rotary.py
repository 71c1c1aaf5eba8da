"""kernels/rotary.py: the Triton kernel against rotary_embedding_ref (HF's order), and both against
the model's current RotaryEmbedding + apply_rotary path with llama3-scaled frequencies.

Without CUDA the kernel runs under Triton's interpreter on CPU (fp32 and fp16; the interpreter
has no bf16), with CUDA on the GPU in bf16 too.
"""
import pytest
import torch

from tests.kernel_support import DEVICE, ON_GPU, load_kernels, require_runnable

rotary_module = load_kernels("kernels.rotary")
rotary_embedding = rotary_module.rotary_embedding
rotary_embedding_ref = rotary_module.rotary_embedding_ref
build_cos_sin_cache = rotary_module.build_cos_sin_cache


@pytest.fixture(autouse=True)
def kernels_can_run_here():
    require_runnable(rotary_module)


# bf16: the kernel rounds once from fp32, while the HF-order reference rounds cos/sin (relative
# 2^-9) and both products to bf16 before the add. Where x1*cos and x2*sin cancel, those errors
# (up to ~2 ulps of the products, 0.03125 at magnitude 2..4 for unit-scale inputs) are not
# covered by rtol, so atol is widened to 4e-2; the accuracy check against fp64 below makes up
# for it. fp16 (2^-11) stays within the standard pair.
DTYPE_TOLS = [(torch.float32, 1e-4, 1.3e-6), (torch.float16, 1e-2, 1e-3)]
if ON_GPU:
    DTYPE_TOLS.append((torch.bfloat16, 4e-2, 1e-2))
# (T, Hq, Hkv, D): MHA, GQA with D/2 = 48 (not a power of two), a single kv head
SHAPES = [(1, 8, 8, 128), (5, 12, 4, 96), (123, 4, 1, 64)] + ([(512, 32, 8, 128)] if ON_GPU else [])
MAX_POSITIONS = 4096
PAD = 5  # extra NaN columns at the end of each fused qkv row


def default_inv_freq(head_dim, theta=10000.0):
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, layout, gen):
    """q, k, v [T, H, D]; "fused": views into one [T, (Hq + 2Hkv) * D + PAD] buffer (also returned)."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    buf = torch.full((num_tokens, width + PAD), float("nan"), dtype=dtype)
    buf[:, :width] = torch.randn(num_tokens, width, generator=gen).to(dtype)
    buf = buf.to(DEVICE)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = buf[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = buf[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = buf[:, q_size + kv_size:width].view(num_tokens, num_kv_heads, head_dim)
    if layout == "separate":
        return q.contiguous(), k.contiguous(), v, None
    return q, k, v, buf


def assert_at_least_as_accurate_as_hf(q, k, q_in, k_in, positions, cos, sin):
    """Half dtypes: the fp32 kernel must be no further from exact (fp64) RoPE than HF's order is."""
    exact_q, exact_k = rotary_embedding_ref(q_in.double(), k_in.double(), positions, cos.double(), sin.double())
    hf_q, hf_k = rotary_embedding_ref(q_in, k_in, positions, cos, sin)
    for got, hf, exact in ((q, hf_q, exact_q), (k, hf_k, exact_k)):
        kernel_err = (got.double() - exact).abs()
        hf_err = (hf.double() - exact).abs()
        assert kernel_err.max() <= hf_err.max() and kernel_err.mean() <= hf_err.mean()


# The interpreter spends ~10 ms a program: T = 123 runs in the fused layout only on CPU.
CASES = [(shape, layout) for shape in SHAPES for layout in ("separate", "fused")
         if ON_GPU or layout == "fused" or shape[0] < 100]


@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS)
@pytest.mark.parametrize("shape,layout", CASES)
def test_rotary_matches_ref(shape, layout, dtype, atol, rtol):
    num_tokens, num_heads, num_kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(num_tokens * 100 + head_dim)
    q, k, v, buf = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, layout, gen)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen)
    positions[0] = MAX_POSITIONS - 1  # the last row of the cache is reachable
    positions = positions.to(DEVICE)
    cos, sin = build_cos_sin_cache(default_inv_freq(head_dim).to(DEVICE), MAX_POSITIONS)
    q_in, k_in = q.clone(), k.clone()
    buf_before = None if buf is None else buf.clone()

    assert rotary_embedding(q, k, positions, cos, sin) is None

    expected_q, expected_k = rotary_embedding_ref(q_in, k_in, positions, cos, sin)
    torch.testing.assert_close(q, expected_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(k, expected_k, atol=atol, rtol=rtol)
    if buf is not None:  # v and the row padding are untouched
        width = (num_heads + 2 * num_kv_heads) * head_dim
        v_start = (num_heads + num_kv_heads) * head_dim
        torch.testing.assert_close(buf[:, v_start:], buf_before[:, v_start:], atol=0, rtol=0, equal_nan=True)
        assert buf[:, width:].isnan().all()
    if dtype != torch.float32:
        assert_at_least_as_accurate_as_hf(q, k, q_in, k_in, positions, cos, sin)


LLAMA3_SCALING = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 1.3e-6), (torch.float16, 1e-2, 1e-3),
                                             (torch.bfloat16, 4e-2, 1e-2)])
def test_llama3_scaling_matches_model_path(dtype, atol, rtol):
    """The model's inv_freq through build_cos_sin_cache gives the model's own q/k: bitwise for the
    reference (same ops, same order), within tolerance for the fp32 kernel."""
    from engine.models.llama import RotaryEmbedding, apply_rotary, compute_inv_freq

    head_dim, theta, max_positions = 128, 500000.0, 131072
    gen = torch.Generator().manual_seed(7)
    positions = torch.tensor([0, 1, 8191, 8192, 40000, 100003, max_positions - 1]).to(DEVICE)
    q = torch.randn(len(positions), 4, head_dim, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(len(positions), 2, head_dim, generator=gen).to(dtype).to(DEVICE)
    inv_freq = compute_inv_freq(head_dim, theta, LLAMA3_SCALING, torch.device(DEVICE))
    cos_cache, sin_cache = build_cos_sin_cache(inv_freq, max_positions)

    model_rope = RotaryEmbedding(head_dim, theta, LLAMA3_SCALING).to(DEVICE)
    cos, sin = model_rope(positions, dtype)  # [T, D] in dtype
    model_q, model_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    ref_q, ref_k = rotary_embedding_ref(q, k, positions, cos_cache, sin_cache)
    torch.testing.assert_close(ref_q, model_q, atol=0, rtol=0)
    torch.testing.assert_close(ref_k, model_k, atol=0, rtol=0)
    if dtype == torch.bfloat16 and not ON_GPU:
        return  # the interpreter has no bf16
    q_in, k_in = q.clone(), k.clone()
    rotary_embedding(q, k, positions, cos_cache, sin_cache)
    torch.testing.assert_close(q, model_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(k, model_k, atol=atol, rtol=rtol)
    if dtype != torch.float32:
        assert_at_least_as_accurate_as_hf(q, k, q_in, k_in, positions, cos_cache, sin_cache)


def test_build_cos_sin_cache_is_the_angle_table():
    inv_freq = default_inv_freq(64)
    cos, sin = build_cos_sin_cache(inv_freq, 300)
    angles = torch.arange(300, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (300, 32)
    torch.testing.assert_close(cos.double(), angles.cos(), atol=1e-4, rtol=1.3e-6)
    torch.testing.assert_close(sin.double(), angles.sin(), atol=1e-4, rtol=1.3e-6)


def test_rotary_zero_tokens():
    q, k = torch.empty(0, 4, 64, device=DEVICE), torch.empty(0, 2, 64, device=DEVICE)
    cos, sin = build_cos_sin_cache(default_inv_freq(64).to(DEVICE), 16)
    rotary_embedding(q, k, torch.empty(0, dtype=torch.long, device=DEVICE), cos, sin)


def _bad_inputs():
    q = torch.zeros(3, 4, 64, device=DEVICE)
    k = torch.zeros(3, 2, 64, device=DEVICE)
    pos = torch.zeros(3, dtype=torch.long, device=DEVICE)
    cos, sin = build_cos_sin_cache(default_inv_freq(64).to(DEVICE), 16)
    ok = dict(q=q, k=k, positions=pos, cos_cache=cos, sin_cache=sin)
    return {
        "q not 3-D": (dict(ok, q=q[0]), "q must be"),
        "odd D": (dict(ok, q=torch.zeros(3, 4, 63, device=DEVICE), k=torch.zeros(3, 2, 63, device=DEVICE)), "even"),
        "k head dim": (dict(ok, k=torch.zeros(3, 2, 32, device=DEVICE)), "k must be"),
        "k tokens": (dict(ok, k=k[:2]), "k must be"),
        "D stride": (dict(ok, q=torch.zeros(3, 64, 4, device=DEVICE).transpose(1, 2)), "unit stride along D"),
        "k dtype": (dict(ok, k=k.half()), "share one dtype"),
        "positions float": (dict(ok, positions=pos.float()), "positions must be"),
        "positions shape": (dict(ok, positions=pos[:2]), "positions must be"),
        "cos half dim": (dict(ok, cos_cache=cos[:, :16].contiguous()), "cos_cache must be"),
        "sin dtype": (dict(ok, sin_cache=sin.half()), "sin_cache must be"),
        "cos/sin rows": (dict(ok, sin_cache=sin[:8]), "differ"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_rotary_rejects_bad_inputs(case):
    kwargs, message = _bad_inputs()[case]
    with pytest.raises(ValueError, match=message):
        rotary_embedding(**kwargs)


def test_build_cos_sin_cache_rejects_bad_inputs():
    with pytest.raises(ValueError, match="inv_freq must be"):
        build_cos_sin_cache(default_inv_freq(64).double(), 16)
    with pytest.raises(ValueError, match="max_positions"):
        build_cos_sin_cache(default_inv_freq(64), 0)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_rotary_replays_in_cuda_graph():
    gen = torch.Generator().manual_seed(8)
    q, k, _, buf = make_qkv(64, 32, 8, 128, torch.bfloat16, "fused", gen)
    positions = torch.randint(0, MAX_POSITIONS, (64,), generator=gen).to(DEVICE)
    cos, sin = build_cos_sin_cache(default_inv_freq(128).to(DEVICE), MAX_POSITIONS)
    rotary_embedding(q, k, positions, cos, sin)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rotary_embedding(q, k, positions, cos, sin)
    _, _, _, fresh = make_qkv(64, 32, 8, 128, torch.bfloat16, "fused", gen)
    buf.copy_(fresh)
    positions.copy_(torch.randint(0, MAX_POSITIONS, (64,), generator=gen))
    expected_q, expected_k = rotary_embedding_ref(q.clone(), k.clone(), positions, cos, sin)
    graph.replay()
    torch.testing.assert_close(q, expected_q, atol=4e-2, rtol=1e-2)
    torch.testing.assert_close(k, expected_k, atol=4e-2, rtol=1e-2)
