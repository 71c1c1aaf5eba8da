"""kernels/rotary_write_kv.py: the fused kernel against the two kernels it replaces
(kernels/rotary.py then kernels/kv_cache.py: bitwise equal, the same math) and against the eager
references (rotary_embedding_ref then write_kv_ref, within the rotary tolerances).

Without CUDA the kernels run under Triton's interpreter on CPU (fp32 and fp16; the interpreter
has no bf16), with CUDA on the GPU in bf16 too.
"""
import pytest
import torch

from tests.kernel_support import DEVICE, ON_GPU, load_kernels, require_runnable

fused_module = load_kernels("kernels.rotary_write_kv")
rotary_module = load_kernels("kernels.rotary")
kv_cache_module = load_kernels("kernels.kv_cache")
rotary_write_kv = fused_module.rotary_write_kv
rotary_write_kv_ref = fused_module.rotary_write_kv_ref
build_cos_sin_cache = rotary_module.build_cos_sin_cache


@pytest.fixture(autouse=True)
def kernels_can_run_here():
    for module in (fused_module, rotary_module, kv_cache_module):
        require_runnable(module)


# (dtype, atol, rtol) against the HF-order reference: tests/test_rotary.py says why bf16's atol
# is wider. Against the two kernels every comparison is exact.
DTYPE_TOLS = [(torch.float32, 1e-4, 1.3e-6), (torch.float16, 1e-2, 1e-3)]
if ON_GPU:
    DTYPE_TOLS.append((torch.bfloat16, 4e-2, 1e-2))
# (T, Hq, Hkv, D, block_size): MHA, GQA with D/2 = 48 over tiny blocks, a single kv head
SHAPES = [(1, 8, 8, 128, 16), (5, 12, 4, 96, 4), (37, 4, 1, 64, 16)]
if ON_GPU:
    SHAPES.append((512, 32, 8, 128, 16))
MAX_POSITIONS = 4096
PAD = 5  # NaN columns at the end of each fused qkv row


def default_inv_freq(head_dim, theta=10000.0):
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def make_case(shape, dtype, layout, gen, cache_dtype=None):
    """q, k, v views into one NaN-padded qkv buffer ("fused") or contiguous tensors; NaN-poisoned
    caches (k and v the halves of one tensor when fused); distinct slots, every third row -1."""
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = shape
    width = (num_heads + 2 * num_kv_heads) * head_dim
    buf = torch.full((num_tokens, width + PAD), float("nan"), dtype=dtype)
    buf[:, :width] = torch.randn(num_tokens, width, generator=gen).to(dtype)
    buf = buf.to(DEVICE)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = buf[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = buf[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = buf[:, q_size + kv_size:width].view(num_tokens, num_kv_heads, head_dim)
    num_blocks = num_tokens // block_size + 3
    cache_dtype = cache_dtype or dtype
    if layout == "fused":
        kv = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"),
                        dtype=cache_dtype, device=DEVICE)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                             dtype=cache_dtype, device=DEVICE)
        v_cache = k_cache.clone()
    num_slots = num_blocks * block_size
    slots = torch.cat([torch.tensor([num_slots - 1]),
                       torch.randperm(num_slots - 1, generator=gen)[:num_tokens - 1]])
    slots[2::3] = -1
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), generator=gen)
    positions[0] = MAX_POSITIONS - 1
    cos, sin = build_cos_sin_cache(default_inv_freq(head_dim).to(DEVICE), MAX_POSITIONS)
    return dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots.to(DEVICE),
                positions=positions.to(DEVICE), cos_cache=cos, sin_cache=sin), buf


def run_two_kernels(shape, dtype, layout, seed, cache_dtype=None, slot_dtype=None, no_slots=False):
    """The path the fused kernel replaces, on the same case made again (same layout too)."""
    c, _ = make_case(shape, dtype, layout, torch.Generator().manual_seed(seed), cache_dtype)
    adjust(c, slot_dtype, no_slots)
    rotary_module.rotary_embedding(c["q"], c["k"], c["positions"], c["cos_cache"], c["sin_cache"])
    kv_cache_module.write_kv(c["k"], c["v"], c["k_cache"], c["v_cache"], c["slot_mapping"])
    return c


def adjust(case, slot_dtype=None, no_slots=False):
    if slot_dtype is not None:
        case["slot_mapping"] = case["slot_mapping"].to(slot_dtype)
        case["positions"] = case["positions"].to(slot_dtype)
    if no_slots:
        case["slot_mapping"].fill_(-1)


def exact(got, want):
    if got.element_size() == 1:     # FP8: compare the bits (NaN poison included)
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return
    torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS)
@pytest.mark.parametrize("layout", ["separate", "fused"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_equals_the_two_kernels_and_matches_ref(shape, layout, dtype, atol, rtol):
    seed = sum(shape)
    case, buf = make_case(shape, dtype, layout, torch.Generator().manual_seed(seed))
    two = run_two_kernels(shape, dtype, layout, seed)
    q_in, k_in, v_in = case["q"].clone(), case["k"].clone(), case["v"].clone()
    expected_k_cache, expected_v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    ref_q, ref_k = rotary_write_kv_ref(q_in, k_in, v_in, expected_k_cache, expected_v_cache,
                                       case["slot_mapping"], case["positions"], case["cos_cache"],
                                       case["sin_cache"])
    buf_before = buf.clone()

    assert rotary_write_kv(**case) is None

    for name in ("q", "k", "v", "k_cache", "v_cache"):
        exact(case[name], two[name])
    torch.testing.assert_close(case["q"], ref_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(case["k"], ref_k, atol=atol, rtol=rtol)
    torch.testing.assert_close(case["k_cache"], expected_k_cache, atol=atol, rtol=rtol, equal_nan=True)
    exact(case["v_cache"], expected_v_cache)
    exact(case["v"], v_in)
    assert case["k_cache"].isnan().any()                          # unwritten slots keep their poison
    if layout == "fused":     # v and the NaN row padding of the qkv buffer are untouched
        num_tokens, num_heads, num_kv_heads, head_dim, _ = shape
        v_start = (num_heads + num_kv_heads) * head_dim
        exact(buf[:, v_start:], buf_before[:, v_start:])


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float16),
                                               (torch.float32, torch.float8_e4m3fn),
                                               (torch.float16, torch.float8_e4m3fn)])
def test_cache_dtype_cast_equals_the_two_kernels(slot_dtype, dtype, cache_dtype):
    """Rows into caches of another dtype (fp16, or FP8 clamped to +-448): the rotated k is
    rounded to k's dtype, then cast once, as write_kv casts the rotated k it reads back."""
    shape = (9, 4, 2, 64, 8)
    case, _ = make_case(shape, dtype, "fused", torch.Generator().manual_seed(11), cache_dtype=cache_dtype)
    adjust(case, slot_dtype)
    two = run_two_kernels(shape, dtype, "fused", 11, cache_dtype, slot_dtype)
    rotary_write_kv(**case)
    assert not case["k_cache"].float().isnan().all()
    for name in ("q", "k", "k_cache", "v_cache"):
        exact(case[name], two[name])


def test_all_padding_rotates_but_writes_nothing():
    shape = (4, 4, 2, 64, 4)
    case, _ = make_case(shape, torch.float32, "separate", torch.Generator().manual_seed(3))
    adjust(case, no_slots=True)
    k_in = case["k"].clone()
    two = run_two_kernels(shape, torch.float32, "separate", 3, no_slots=True)
    rotary_write_kv(**case)
    assert case["k_cache"].isnan().all() and case["v_cache"].isnan().all()
    exact(case["q"], two["q"])
    exact(case["k"], two["k"])
    assert not torch.equal(case["k"], k_in)


def test_zero_tokens():
    case, _ = make_case((1, 4, 2, 64, 4), torch.float32, "separate", torch.Generator().manual_seed(4))
    empty = {name: t[:0] for name, t in case.items() if name in ("q", "k", "v", "slot_mapping", "positions")}
    rotary_write_kv(**{**case, **empty})
    assert case["k_cache"].isnan().all()


def _bad_inputs():
    case, _ = make_case((3, 4, 2, 64, 4), torch.float32, "separate", torch.Generator().manual_seed(5))
    q, k, cache, pos, cos = case["q"], case["k"], case["k_cache"], case["positions"], case["cos_cache"]
    return {
        "q not 3-D": (dict(case, q=q[0]), "q must be"),
        "v shape": (dict(case, v=k[:2]), "q must be"),
        "k head dim": (dict(case, k=k[..., :32], v=k[..., :32]), "k must be"),
        "cache heads": (dict(case, k_cache=cache[:, :, :1], v_cache=cache[:, :, :1]), "caches must be"),
        "k dtype": (dict(case, k=k.half(), v=k.half()), "share one dtype"),
        "cache int": (dict(case, k_cache=cache.long(), v_cache=cache.long()), "k_cache must be one of"),
        "D stride": (dict(case, q=torch.zeros(3, 64, 4, device=DEVICE).transpose(1, 2)), "unit stride along D"),
        "positions float": (dict(case, positions=pos.float()), "positions must be"),
        "slots shape": (dict(case, slot_mapping=case["slot_mapping"][:2]), "slot_mapping must be"),
        "cos half dim": (dict(case, cos_cache=cos[:, :16].contiguous()), "cos_cache must be"),
        "cos/sin rows": (dict(case, sin_cache=case["sin_cache"][:8]), "differ"),
    }


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_rejects_bad_inputs(name):
    kwargs, message = _bad_inputs()[name]
    with pytest.raises(ValueError, match=message):
        rotary_write_kv(**kwargs)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_replays_in_cuda_graph():
    case, buf = make_case((64, 32, 8, 128, 16), torch.bfloat16, "fused", torch.Generator().manual_seed(8))
    rotary_write_kv(**case)                  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rotary_write_kv(**case)
    fresh, fresh_buf = make_case((64, 32, 8, 128, 16), torch.bfloat16, "fused",
                                 torch.Generator().manual_seed(9))
    buf.copy_(fresh_buf)
    for name in ("slot_mapping", "positions", "k_cache", "v_cache"):
        case[name].copy_(fresh[name])
    two = run_two_kernels((64, 32, 8, 128, 16), torch.bfloat16, "fused", 9)
    graph.replay()
    for name in ("q", "k", "k_cache", "v_cache"):
        exact(case[name], two[name])


@pytest.mark.parametrize("dtype", [d for d, _, _ in DTYPE_TOLS])
@pytest.mark.parametrize("num_parts,bias", [(1, False), (2, True), (3, False)])
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_qkv_from_gemm_partials_gives_the_bits_of_the_merged_qkv(shape, dtype, num_parts, bias):
    """qkv_parts (the qkv projection's unmerged K slices, + qkv_bias): q, k, v are merged from
    them (sum in slice order, + bias, rounded) and then rotated and written as usual: q, k, v and
    both caches bitwise what merging first and running the kernel on the merged qkv gives."""
    num_tokens, num_heads, num_kv_heads, head_dim, _ = shape
    width = (num_heads + 2 * num_kv_heads) * head_dim
    gen = torch.Generator().manual_seed(num_parts)
    parts = torch.randn(num_parts, num_tokens, width, generator=gen).to(DEVICE)
    b = torch.randn(width, generator=gen).to(dtype).to(DEVICE) if bias else None
    acc = torch.zeros(num_tokens, width, device=DEVICE)
    for p in parts:
        acc += p
    merged = (acc + (b.float() if bias else 0)).to(dtype)
    results = []
    for from_parts in (False, True):
        case, buf = make_case(shape, dtype, "fused", torch.Generator().manual_seed(3))
        if from_parts:
            buf[:, :width] = float("nan")        # not read: q, k, v come from the parts
            rotary_write_kv(**case, qkv_parts=parts, qkv_bias=b)
        else:
            buf[:, :width] = merged
            rotary_write_kv(**case)
        results.append((buf, case["k_cache"], case["v_cache"]))
    for want, got in zip(*results):
        exact(got, want)


def test_qkv_parts_bad_forms_are_named():
    case, _ = make_case(SHAPES[1], torch.float32, "fused", torch.Generator().manual_seed(4))
    width = (12 + 2 * 4) * 96
    with pytest.raises(ValueError, match=r"qkv_parts must be float32 \[S >= 1, T=5, \(Hq \+ 2 Hkv\) D=1920\]"):
        rotary_write_kv(**case, qkv_parts=torch.zeros(2, 5, width - 1, device=DEVICE))
    with pytest.raises(ValueError, match="qkv_bias must be"):
        rotary_write_kv(**case, qkv_parts=torch.zeros(2, 5, width, device=DEVICE), qkv_bias=torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="qkv_bias is given but qkv_parts is None"):
        rotary_write_kv(**case, qkv_bias=torch.zeros(width, device=DEVICE))
