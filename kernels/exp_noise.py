"""Exp(1) noise for the sampler's race (kernels/race_sample.py), every row in one launch, from
counter-based random bits.

Math (`exponential_noise_ref`): row b has a 64-bit key K_b and a stream number s_b. Column v's 32
random bits r are word v mod 4 of Philox4x32-10 (Salmon et al., SC'11; triton's tl.philox) with key
K_b and counter (v div 4, s_b, 0, 0): a counter gives four columns, as curand's uniform4 does.
Their top 31 bits x give u = (x + 1/2) 2^-31, in (0, 1), never 0 or 1, and q = -log(1 - u), an
Exp(1) draw, rounded to fp32. Both compute in fp64, where 1 - u is exact: in fp32 it would round
the small draws (the ones that win a race) by up to 6e-5 of themselves.

Why: the sampler drew each seeded row's noise with its own torch generator, re-seeded and
launched once a row each step (~2.2 ms of host time a step at 256 seeded rows:
benchmarks/h200/penalties.md). Here a row's noise is a function of (K_b, s_b) alone, so one
launch draws every row, seeded or not, and a seeded row still draws what it would alone.

Layouts: keys [B] int64 (the key's 64 bits), streams [B] int32; returns [B, V] fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["exponential_noise", "exponential_noise_ref", "philox_ref", "BLOCK"]

BLOCK = 2048


@triton.jit
def _exponential_noise_kernel(keys_ptr, streams_ptr, out_ptr, V, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    counters = tl.program_id(1) * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
    stream = tl.load(streams_ptr + row).to(tl.uint32, bitcast=True)
    zero = counters.to(tl.uint32) * 0
    r0, r1, r2, r3 = tl.philox(key, counters.to(tl.uint32), stream + zero, zero, zero)
    # [BLOCK / 4, 2, 2] holding (i, k, m) = word 2k + m of counter i: flat, column 4i + 2k + m.
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK,))
    x = (r >> 1).to(tl.int32, bitcast=True)
    u = (x.to(tl.float64) + 0.5) * 4.656612873077393e-10          # 2^-31
    q = -tl.log(1.0 - u)
    tl.store(out_ptr + row * stride_o + cols, q.to(tl.float32), mask=cols < V)


def exponential_noise(keys: torch.Tensor, streams: torch.Tensor, num_cols: int, *,
                      block: int = BLOCK) -> torch.Tensor:
    """[B, num_cols] fp32 Exp(1) noise, row b from (keys[b], streams[b]) (module docstring)."""
    if keys.dim() != 1 or keys.dtype != torch.int64:
        raise ValueError(f"keys must be [B] int64, got {keys.dtype} {list(keys.shape)}")
    if streams.shape != keys.shape or streams.dtype != torch.int32 or streams.device != keys.device:
        raise ValueError(f"streams must be [{keys.shape[0]}] int32 on {keys.device}, got {streams.dtype} "
                         f"{list(streams.shape)} on {streams.device}")
    if keys.shape[0] > 1 and (keys.stride(0) != 1 or streams.stride(0) != 1):
        raise ValueError(f"keys and streams must be contiguous, got strides {keys.stride()} and "
                         f"{streams.stride()}")
    if num_cols < 1:
        raise ValueError(f"num_cols must be >= 1, got {num_cols}")
    if block < 4 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 4, got {block}")
    out = torch.empty(keys.shape[0], num_cols, dtype=torch.float32, device=keys.device)
    if keys.shape[0]:
        _exponential_noise_kernel[(keys.shape[0], triton.cdiv(num_cols, block))](
            keys, streams, out, num_cols, out.stride(0), BLOCK=block, num_warps=4)
    return out


_M32 = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of a * b for a constant a and b int64 holding uint32 values; the
    product is taken in 16-bit halves of a so that nothing passes int64's 63 bits."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    lo_part = a_lo * b                                   # < 2^48
    hi_part = a_hi * b                                   # < 2^48
    hi = (hi_part + (lo_part >> 16)) >> 16
    lo = ((hi_part << 16) + lo_part) & _M32
    return hi & _M32, lo


def philox_ref(key: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor,
               c3: torch.Tensor, rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """Philox4x32 on int64 tensors holding uint32 words (broadcast); key: int64, its 64 bits
    split low word first. Returns the four output words."""
    k0 = key & _M32
    k1 = (key >> 32) & _M32
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(0xCD9E8D57, c2)
        hi_a, lo_a = _mulhilo(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


def exponential_noise_ref(keys: torch.Tensor, streams: torch.Tensor, num_cols: int) -> torch.Tensor:
    """[B, num_cols] fp32: the module docstring's q, from eager int64 arithmetic and log1p."""
    counters = torch.arange(-(-num_cols // 4), dtype=torch.int64, device=keys.device).unsqueeze(0)
    zero = torch.zeros_like(counters)
    words = philox_ref(keys.unsqueeze(1), counters, (streams.to(torch.int64) & _M32).unsqueeze(1), zero, zero)
    r = torch.stack(words, dim=-1).flatten(1)[:, :num_cols]               # column 4i + w: word w of i
    u = ((r >> 1).double() + 0.5) * 2.0 ** -31
    return (-torch.log1p(-u)).float()
