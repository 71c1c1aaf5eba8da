"""Top-k and top-p (nucleus) truncation of logits rows without sorting them, one launch.

Math (`top_k_top_p_ref`, the sampler's definition): order a row's values descending, equal
values by ascending id (a stable sort). Keep the first k (k = 0: all). Over the kept ones,
renormalised (p_i = exp(x_i - max) / Z), keep an element while the mass of those before it is
below top_p; the first is always kept (top_p = 1: all). Every other value becomes -inf.

Why not the sort: at 256 rows of Llama 3's 128,256 logits the sort, its softmax, cumulative
sum and scatter back cost ~3.5 ms of a ~15.5 ms decode step on an H200
(benchmarks/h200/penalties.md, sampling_635bcc5).

Here one program owns a row and finds the two cut points by bisection over the values, each
probe a pass over the row:
- each fp32 value maps to an int32 key ordered as the values (-0.0 taken as +0.0, so equal
  values have equal keys);
- top-k: the largest key vk with at least k values >= it; of the values equal to vk, the first
  k - #(> vk) by id are kept;
- top-p, over what top-k kept: the smallest key t0 >= vk whose strictly greater values hold a
  mass M(t0) < top_p. Every value > t0 is kept. Of those equal to t0 the first n by id are kept,
  n = ceil((top_p - M(t0)) / p(t0)): the j-th has mass M(t0) + (j - 1) p(t0) before it.
- a last pass writes the kept values and -inf, counting ties in id order.

The masses are fp32 sums in chunk order where the reference's are torch's cumulative sum: a row
whose mass before an element lies within rounding of top_p may keep one element more or fewer.
Everything else is exact.

Layouts: x [B, V] fp32 with unit column stride; top_k [B] int64 (0 or >= V: off) or None;
top_p [B] fp32 (>= 1: off) or None. Returns a new [B, V] fp32 tensor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["top_k_top_p", "top_k_top_p_ref"]

BLOCK = 2048
NUM_WARPS = 8
_INT32_MIN = tl.constexpr(-2147483648)
_INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _key(x):
    """int32 keys ordered as the fp32 values x (with -0.0 as +0.0)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _value(key):
    """The fp32 value of a key (the inverse of _key)."""
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _top_k_top_p_kernel(x_ptr, out_ptr, k_ptr, p_ptr, V, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)

    # The keys' range and the largest value.
    hi = tl.full((), _INT32_MIN, tl.int32)
    lo = tl.full((), _INT32_MAX, tl.int32)
    for c in range(0, V, BLOCK):
        inside = c + offs < V
        key = _key(tl.load(x_row + c + offs, mask=inside, other=0.0))
        hi = tl.maximum(hi, tl.max(tl.where(inside, key, _INT32_MIN), 0))
        lo = tl.minimum(lo, tl.min(tl.where(inside, key, _INT32_MAX), 0))
    m = _value(hi)

    # Top-k: the cut key vk and how many values equal to it stay (the first by id).
    vk = lo.to(tl.int64)
    nk = tl.zeros((), tl.int64) + V           # every value equal to lo (at most V)
    k = tl.load(k_ptr + row)
    if (k > 0) & (k < V):
        a = lo.to(tl.int64)
        b = hi.to(tl.int64)
        for _ in range(32):                 # the largest t with #(key >= t) >= k
            mid = a + (b - a + 1) // 2
            cnt = tl.zeros((), tl.int64)
            for c in range(0, V, BLOCK):
                inside = c + offs < V
                key = _key(tl.load(x_row + c + offs, mask=inside, other=0.0))
                cnt += tl.sum((inside & (key >= mid)).to(tl.int64), 0)
            a = tl.where(cnt >= k, mid, a)
            b = tl.where(cnt >= k, b, mid - 1)
        vk = a
        above = tl.zeros((), tl.int64)
        for c in range(0, V, BLOCK):
            inside = c + offs < V
            key = _key(tl.load(x_row + c + offs, mask=inside, other=0.0))
            above += tl.sum((inside & (key > vk)).to(tl.int64), 0)
        nk = k - above

    # Top-p over what top-k kept: the cut key t0 >= vk and how many values equal to it stay.
    t0 = vk
    n = nk
    top_p = tl.load(p_ptr + row)
    if top_p < 1.0:
        ties_k = tl.zeros((), tl.int64)
        z = tl.zeros((), tl.float32)
        for c in range(0, V, BLOCK):
            inside = c + offs < V
            x = tl.load(x_row + c + offs, mask=inside, other=0.0)
            key = _key(x)
            z += tl.sum(tl.where(inside & (key > vk), tl.exp(x - m), 0.0), 0)
            ties_k += tl.sum((inside & (key == vk)).to(tl.int64), 0)
        nk = tl.minimum(nk, ties_k)
        z += nk.to(tl.float32) * tl.exp(_value(vk.to(tl.int32)) - m)
        a = vk
        b = hi.to(tl.int64)
        for _ in range(32):                 # the smallest t in [vk, hi] with M(t) < top_p
            mid = a + (b - a) // 2
            mass = tl.zeros((), tl.float32)
            for c in range(0, V, BLOCK):
                inside = c + offs < V
                x = tl.load(x_row + c + offs, mask=inside, other=0.0)
                mass += tl.sum(tl.where(inside & (_key(x) > mid), tl.exp(x - m) / z, 0.0), 0)
            a = tl.where(mass < top_p, a, mid + 1)
            b = tl.where(mass < top_p, mid, b)
        t0 = a
        mass = tl.zeros((), tl.float32)
        ties = tl.zeros((), tl.int64)
        for c in range(0, V, BLOCK):
            inside = c + offs < V
            x = tl.load(x_row + c + offs, mask=inside, other=0.0)
            key = _key(x)
            mass += tl.sum(tl.where(inside & (key > t0), tl.exp(x - m) / z, 0.0), 0)
            ties += tl.sum((inside & (key == t0)).to(tl.int64), 0)
        ties = tl.where(t0 == vk, nk, ties)
        p0 = tl.exp(_value(t0.to(tl.int32)) - m) / z
        # At most V, and all the ties where p0 rounds to 0 (top_p within rounding of 1).
        ratio = tl.minimum(tl.where(p0 > 0.0, (top_p - mass) / p0, V * 1.0), V * 1.0)
        n = tl.maximum(tl.minimum(tl.ceil(ratio).to(tl.int64), ties), 1)

    # Keep every value above t0 and the first n equal to it (by id); the rest become -inf.
    seen = tl.zeros((), tl.int64)
    out_row = out_ptr + row * stride_o
    for c in range(0, V, BLOCK):
        inside = c + offs < V
        x = tl.load(x_row + c + offs, mask=inside, other=0.0)
        key = _key(x)
        tie = inside & (key == t0)
        rank = seen + tl.cumsum(tie.to(tl.int64), 0) - tie.to(tl.int64)
        keep = (key > t0) | (tie & (rank < n))
        tl.store(out_row + c + offs, tl.where(keep, x, float("-inf")), mask=inside)
        seen += tl.sum(tie.to(tl.int64), 0)


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, *,
                block: int = BLOCK, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """`top_k_top_p_ref` without the sort (module docstring): a new [B, V] fp32 tensor.
    block / num_warps: the values a program reads a step and its warps (the probe's knobs)."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError(f"logits must be [B, V] fp32 with unit column stride, got {logits.dtype} "
                         f"{list(logits.shape)} stride {logits.stride()}")
    num_rows, vocab = logits.shape
    out = torch.empty_like(logits)
    if num_rows == 0 or vocab == 0:
        return out
    for name, t, dtype in (("top_k", top_k, torch.int64), ("top_p", top_p, torch.float32)):
        if t is not None and (t.shape != (num_rows,) or t.dtype != dtype or t.device != logits.device):
            raise ValueError(f"{name} must be a {dtype} [{num_rows}] tensor on {logits.device}")
    # One compiled variant: what is off comes in as its neutral value (k = 0, top_p = 1).
    if top_k is None:
        top_k = torch.zeros(num_rows, dtype=torch.int64, device=logits.device)
    if top_p is None:
        top_p = torch.ones(num_rows, dtype=torch.float32, device=logits.device)
    _top_k_top_p_kernel[(num_rows,)](logits, out, top_k, top_p, vocab, logits.stride(0), out.stride(0),
                                     BLOCK=block, num_warps=num_warps)
    return out


def top_k_top_p_ref(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the k largest logits, then the smallest prefix of those (by probability,
    renormalized over the survivors) whose mass reaches top_p; the rest become -inf.

    Works on the descending stable sort, so ties are kept lowest id first."""
    num_rows, vocab_size = logits.shape
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)   # [B, V]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)
        position = torch.arange(vocab_size, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(position >= k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(-1)
        # Mass strictly before each position: keep a token while that is still below top_p.
        mass_before = torch.cat([probs.new_zeros(num_rows, 1), probs.cumsum(-1)[:, :-1]], dim=1)
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)
