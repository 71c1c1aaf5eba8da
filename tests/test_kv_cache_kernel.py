"""kernels/kv_cache.py: the Triton write_kv against kernels.attention_ref.write_kv_ref.

Without CUDA the kernel runs under Triton's interpreter on CPU (fp32 and fp16; the interpreter
has no bf16), with CUDA on the GPU in bf16 too. A write is a copy (or one cast), so every
element must match exactly, and every slot not written must keep its NaN poison.
"""
import pytest
import torch

from kernels.attention_ref import write_kv_ref
from tests.kernel_support import DEVICE, ON_GPU, load_kernels, require_runnable

kv_cache_module = load_kernels("kernels.kv_cache")
write_kv = kv_cache_module.write_kv


@pytest.fixture(autouse=True)
def kernels_can_run_here():
    require_runnable(kv_cache_module)


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# (T, Hkv, D, block_size): one token, D = 96 (not a power of two), many tokens over small blocks
SHAPES = [(1, 1, 64, 16), (5, 4, 96, 4), (123, 2, 64, 16)] + ([(4096, 8, 128, 16)] if ON_GPU else [])


def make_kv(num_tokens, num_kv_heads, head_dim, dtype, layout, gen):
    """key, value [T, Hkv, D]; "fused": views into one qkv buffer with two q heads in front."""
    num_q_heads = 2
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype).to(DEVICE)
    k_start, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    key = qkv[:, k_start:k_start + kv_size].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, k_start + kv_size:].view(num_tokens, num_kv_heads, head_dim)
    if layout == "fused":
        return key, value
    return key.contiguous(), value.contiguous()


def make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, layout):
    """NaN-poisoned caches; "fused": k and v are the halves of one [num_blocks, 2, ...] tensor."""
    if layout == "fused":
        kv = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
        return kv[:, 0], kv[:, 1]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
            torch.full(shape, float("nan"), dtype=dtype, device=DEVICE))


def make_slots(num_tokens, num_slots, gen):
    """Distinct random slots, every third row padding (-1), the last slot of the cache used."""
    others = torch.randperm(num_slots - 1, generator=gen)[:num_tokens - 1]
    slots = torch.cat([torch.tensor([num_slots - 1]), others])
    slots[2::3] = -1
    return slots.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("layout", ["separate", "fused"])
def test_write_kv_matches_ref(num_tokens, num_kv_heads, head_dim, block_size, dtype, layout):
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    key, value = make_kv(num_tokens, num_kv_heads, head_dim, dtype, layout, gen)
    num_blocks = num_tokens // block_size + 3
    k_cache, v_cache = make_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, layout)
    slots = make_slots(num_tokens, num_blocks * block_size, gen)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, expected_k, expected_v, slots)

    write_kv(key, value, k_cache, v_cache, slots)

    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0, equal_nan=True)
    assert k_cache.isnan().any() or num_tokens >= num_blocks * block_size  # some slots stay poisoned


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_write_kv_casts_to_cache_dtype(slot_dtype):
    """fp32 rows into an fp16 cache: one round-to-nearest cast, as write_kv_ref's .to()."""
    gen = torch.Generator().manual_seed(1)
    key, value = make_kv(9, 2, 64, torch.float32, "fused", gen)
    key.mul_(1000)  # some values land between fp16 numbers far apart
    k_cache, v_cache = make_caches(4, 8, 2, 64, torch.float16, "separate")
    slots = make_slots(9, 32, gen).to(slot_dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, expected_k, expected_v, slots)
    write_kv(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0, equal_nan=True)


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("key_dtype", DTYPES)
@pytest.mark.parametrize("layout", ["separate", "fused"])
def test_write_kv_into_fp8_caches_as_the_reference(key_dtype, layout):
    """FP8 (e4m3) caches: each value clamped to +-448 and rounded to nearest even, bitwise as
    write_kv_ref (to_cache_dtype) stores it; values past 448 land on 448, not on NaN."""
    gen = torch.Generator().manual_seed(5)
    key, value = make_kv(40, 2, 64, key_dtype, layout, gen)
    key.mul_(300)           # many past e4m3's largest finite value
    k_cache, v_cache = make_caches(8, 8, 2, 64, torch.float8_e4m3fn, layout)
    slots = make_slots(40, 64, gen)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, expected_k, expected_v, slots)
    write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(bits(k_cache), bits(expected_k)) and torch.equal(bits(v_cache), bits(expected_v))
    live = slots[slots >= 0]
    written = k_cache[live // 8, live % 8].float()
    assert written.abs().max() == 448 and not written.isnan().any()
    assert k_cache.float().isnan().any()                # unwritten slots keep their poison


def test_write_kv_all_padding_writes_nothing():
    gen = torch.Generator().manual_seed(2)
    key, value = make_kv(4, 2, 64, torch.float32, "separate", gen)
    k_cache, v_cache = make_caches(2, 4, 2, 64, torch.float32, "separate")
    write_kv(key, value, k_cache, v_cache, torch.full((4,), -1, dtype=torch.long, device=DEVICE))
    assert k_cache.isnan().all() and v_cache.isnan().all()


def test_write_kv_zero_tokens():
    k_cache, v_cache = make_caches(2, 4, 2, 64, torch.float32, "separate")
    empty = torch.empty(0, 2, 64, device=DEVICE)
    write_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.long, device=DEVICE))
    assert k_cache.isnan().all()


def _bad_inputs():
    key = torch.zeros(3, 2, 64, device=DEVICE)
    cache = torch.zeros(4, 8, 2, 64, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.long, device=DEVICE)
    ok = dict(key=key, value=key, k_cache=cache, v_cache=cache, slot_mapping=slots)
    return {
        "key not 3-D": (dict(ok, key=key[0], value=key[0]), "key and value must"),
        "value shape": (dict(ok, value=key[:2]), "key and value must"),
        "cache heads": (dict(ok, k_cache=cache[:, :, :1], v_cache=cache[:, :, :1]), "caches must be"),
        "cache shapes differ": (dict(ok, v_cache=cache[:2]), "caches must be"),
        "slot dtype": (dict(ok, slot_mapping=slots.float()), "slot_mapping must be"),
        "slot shape": (dict(ok, slot_mapping=slots[:2]), "slot_mapping must be"),
        "key int": (dict(ok, key=key.long(), value=key.long()), "key must be one of"),
        "D stride": (dict(ok, key=torch.zeros(3, 64, 2, device=DEVICE).transpose(1, 2)), "unit stride along D"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_write_kv_rejects_bad_inputs(case):
    kwargs, message = _bad_inputs()[case]
    with pytest.raises(ValueError, match=message):
        write_kv(**kwargs)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_write_kv_replays_in_cuda_graph():
    gen = torch.Generator().manual_seed(3)
    key, value = make_kv(64, 8, 128, torch.bfloat16, "fused", gen)
    k_cache, v_cache = make_caches(16, 16, 8, 128, torch.bfloat16, "separate")
    slots = make_slots(64, 256, gen)
    write_kv(key, value, k_cache, v_cache, slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_kv(key, value, k_cache, v_cache, slots)
    new_key, new_value = make_kv(64, 8, 128, torch.bfloat16, "separate", gen)
    key.copy_(new_key)
    value.copy_(new_value)
    slots.copy_(make_slots(64, 256, gen))
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, expected_k, expected_v, slots)
    graph.replay()
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0, equal_nan=True)
