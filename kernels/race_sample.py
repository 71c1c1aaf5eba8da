"""The sampler's last step, top-k / top-p and the exponential race, without sorting the logits.

Math (`race_sample_ref`, the sampler's definition): order a row's logits x descending, equal
values by ascending id (a stable sort). Keep the values >= the k-th largest, its ties too, as vLLM
and HF's TopKLogitsWarper do (k = 0 or >= V: all). Over the kept ones, renormalised, keep an
element while the mass of those before it is below top_p; the first is always kept (top_p = 1:
all). The sampled token is the kept one with the largest p_i / q_i, the first on ties, where
q [B, V] is the caller's Exp(1) noise: a draw from the kept distribution.

Why not the sort: at 256 rows of Llama 3's 128,256 logits the sort, its softmax, cumulative sum,
scatter back, the second softmax, the division and the argmax took 3.9 ms of a ~17 ms decode
step on an H200; this kernel takes 0.25 ms (benchmarks/h200/race_sample.md).

Here one program owns a row and never needs the whole kept set, only whether the race's winner
is in it. With e_i = exp(x_i - max x), "ahead of j" meaning before j in the order above:
- the race: w = argmax e_i / q_i over the candidates (the first on ties);
- the candidates are the values >= t, t the k-th largest value (`kth`, from torch.topk; top-k
  off: -inf), so top-k never rejects;
- the check: w is kept iff mass(ahead of w) / Z < top_p, or nothing is ahead of w (a top_p that
  rounds to 0 in fp32 still keeps the first), Z the mass of the values >= t (top-k off: the
  whole row's);
- if w is not kept, neither is anything behind it (the mass only grows along the order), so
  the next race is over what is ahead of w; the row's largest value is always kept, so it ends.
The winner of the whole race is the kept set's winner as soon as it is kept, which is the common
case: a step is a pass for the max and mass, one for the race, one for the check, and another
race and check for each rejection (with probability about the mass outside the kept set).

The kernel compares e_i / q_i where the reference compares (e_i / Z') / q_i (Z' the kept mass,
torch's softmax), and sums the masses in its own order where the reference takes torch's
cumulative sum: a row whose two best ratios lie within rounding, or whose winner's mass before it
lies within rounding of top_p, may sample another token. Everything else is exact.

Layouts: logits [B, V] fp32, bf16 or fp16 and noise [B, V] fp32, unit column stride (noise > 0);
top_k [B] int64 (0 or >= V: off) or None; top_p [B] fp32 in [0, 1] (1: off) or None; temperature
[B] fp32 > 0 or None (the race runs on logits.float() / temperature). Returns [B] int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.argmax import argmax_rows

__all__ = ["race_sample", "race_sample_ref", "keep_top_k_top_p", "config_for", "warm_up"]

# (BLOCK, num_warps) by the rows: the fastest of seven (2,048-16,384 values a step, 4-16 warps) at
# 1-512 rows on an H200 (benchmarks/h200/race_sample_374efc8.json).
_MANY_ROWS = 128
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# With neither cut, under this many rows the softmax, p / q and kernels/argmax.py's many programs
# a row are faster than a program a row (54 against 80 us at one row, 97 / 94 at 64).
_RACE_MIN_ROWS = 64


def config_for(num_rows: int) -> tuple[int, int]:
    """The kernel's (BLOCK, num_warps) for num_rows rows: a step of 8,192 values while the rows
    leave SMs idle, of 4,096 from 128 rows; 16 warps either way."""
    return (4096, 16) if num_rows >= _MANY_ROWS else (8192, 16)


# Triton's own combine functions through tl.reduce, so the kernel also runs interpreted
# (kernels/paged_attention.py says why).
_MAX = tl.standard._elementwise_max
_MIN = tl.standard._elementwise_min
_SUM = tl.standard._sum_combine


@triton.jit
def _load_scaled(x_row, idx, inside, t):
    """The logits at idx in fp32 divided by the row's temperature t, rounded as torch's fp32
    division rounds (so the kernel sees exactly the reference's logits / t); -inf outside."""
    return tl.math.div_rn(tl.load(x_row + idx, mask=inside, other=float("-inf")).to(tl.float32), t)


@triton.jit
def _race(x_row, q_row, V, t, m, kth, bound_x, bound_i, BLOCK: tl.constexpr):
    """The first id of the largest exp(x - m) / q among the values >= kth ahead of
    (bound_x, bound_i): x > bound_x, or x == bound_x with a smaller id. Each lane keeps its own
    best across the blocks (the first of its ties: ids only grow along a lane), and the lanes
    meet once at the end, so the loop has no reduction, no barrier, between its loads."""
    cols = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], -1.0, tl.float32)
    best_i = tl.full([BLOCK], 0, tl.int32) + V
    for c in range(0, V, BLOCK):
        idx = c + cols
        inside = idx < V
        x = _load_scaled(x_row, idx, inside, t)
        q = tl.load(q_row + idx, mask=inside, other=1.0)
        cand = inside & (x >= kth) & ((x > bound_x) | ((x == bound_x) & (idx < bound_i)))
        score = tl.where(cand, tl.exp(x - m) / q, -1.0)
        take = score > best
        best = tl.where(take, score, best)
        best_i = tl.where(take, idx, best_i)
    top = tl.reduce(best, 0, _MAX)
    return tl.reduce(tl.where(best == top, best_i, V), 0, _MIN)


@triton.jit
def _ahead(x_row, V, t, m, wx, wi, BLOCK: tl.constexpr):
    """How many values are ahead of (wx, wi) and their mass sum exp(x - m) (summed per lane,
    the lanes meeting once at the end)."""
    cols = tl.arange(0, BLOCK)
    count = tl.full([BLOCK], 0, tl.int32)
    mass = tl.full([BLOCK], 0.0, tl.float32)
    for c in range(0, V, BLOCK):
        idx = c + cols
        inside = idx < V
        x = _load_scaled(x_row, idx, inside, t)
        ahead = inside & ((x > wx) | ((x == wx) & (idx < wi)))
        count += ahead.to(tl.int32)
        mass += tl.where(ahead, tl.exp(x - m), 0.0)
    return tl.reduce(count, 0, _SUM), tl.reduce(mass, 0, _SUM)


@triton.jit(do_not_specialize=["has_k", "has_p", "has_t"])
def _race_sample_kernel(x_ptr, q_ptr, kth_ptr, k_ptr, p_ptr, t_ptr, out_ptr, V, stride_x, stride_q, has_k, has_p,
                        has_t, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    # What is off takes its neutral value here (k = V with kth = -inf, top_p = 1), so one variant
    # serves every mix and the launcher fills nothing: k <= 0 (off) or past V keeps the whole row.
    k = tl.load(k_ptr + row, mask=has_k != 0, other=0)
    k = tl.where((k > 0) & (k < V), k, V)
    kth = tl.load(kth_ptr + row, mask=k < V, other=float("-inf"))
    top_p = tl.load(p_ptr + row, mask=has_p != 0, other=1.0)
    t = tl.load(t_ptr + row, mask=has_t != 0, other=1.0)          # x / 1 is x: no temperature
    cols = tl.arange(0, BLOCK)

    # The max m and the mass of the values >= kth: per lane (the mass online, rescaled as the
    # lane's max grows), the lanes meeting once after the loop.
    m_lane = tl.full([BLOCK], float("-inf"), tl.float32)
    mass_lane = tl.full([BLOCK], 0.0, tl.float32)
    for c in range(0, V, BLOCK):
        idx = c + cols
        inside = idx < V
        x = _load_scaled(x_row, idx, inside, t)
        m_new = tl.maximum(m_lane, x)
        scale = tl.where(m_new == m_lane, 1.0, tl.exp(m_lane - m_new))
        # (-inf values weigh nothing, and exp(-inf - -inf) would be NaN)
        kept = inside & (x >= kth) & (x > float("-inf"))
        mass_lane = mass_lane * scale + tl.where(kept, tl.exp(x - m_new), 0.0)
        m_lane = m_new
    m = tl.reduce(m_lane, 0, _MAX)
    kept_mass = tl.reduce(tl.where(mass_lane > 0.0, mass_lane * tl.exp(m_lane - m), 0.0), 0, _SUM)

    # A race finds no candidate (w = V) only in a row without numbers (NaN, +inf: no max to
    # measure against); it ends there and gives id 0 rather than loop or read past the row.
    w = _race(x_row, q_row, V, t, m, kth, float("-inf"), V + 1, BLOCK)
    wx = _load_scaled(x_row, w, w < V, t)
    rejected = w < 0                      # false, as a scalar tensor
    if top_p < 1.0:
        count, mass = _ahead(x_row, V, t, m, wx, w, BLOCK)
        rejected = (mass / kept_mass >= top_p) & (count > 0) & (w < V)
    while rejected:
        w = _race(x_row, q_row, V, t, m, kth, wx, w, BLOCK)
        wx = _load_scaled(x_row, w, w < V, t)
        count, mass = _ahead(x_row, V, t, m, wx, w, BLOCK)
        rejected = (mass / kept_mass >= top_p) & (count > 0) & (w < V)
    tl.store(out_ptr + row, tl.where(w < V, w, 0).to(tl.int64))


def race_sample(logits: torch.Tensor, noise: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, max_top_k: int = 0, *, temperature: torch.Tensor | None = None,
                block: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """`race_sample_ref(logits.float() / temperature[:, None], ...)` without the sort (module
    docstring): [B] int64. logits may come in bf16 / fp16 (a decode graph's buffer): the kernel
    reads them as they are and divides by the temperature as it goes, so no fp32 copy of the
    logits is written. With neither cut and under _RACE_MIN_ROWS rows, the reference's own
    softmax, p / q and argmax, which are faster there.
    max_top_k: the largest k of the rows with top-k on (a host value, so no step waits to read
    it). temperature: [B] fp32 > 0, or None (1). block / num_warps: the values a program reads a
    step and its warps (None: by the rows)."""
    for name, t, dtypes in (("logits", logits, _LOGIT_DTYPES), ("noise", noise, (torch.float32,))):
        if t.dim() != 2 or t.dtype not in dtypes or (t.shape[1] > 1 and t.stride(1) != 1):
            raise ValueError(f"{name} must be [B, V] of {', '.join(str(d) for d in dtypes)} with unit column "
                             f"stride, got {t.dtype} {list(t.shape)} stride {t.stride()}")
    if noise.shape != logits.shape:
        raise ValueError(f"noise must be shaped like logits {list(logits.shape)}, got {list(noise.shape)}")
    num_rows, vocab = logits.shape
    device = logits.device
    for name, t, dtype in (("top_k", top_k, torch.int64), ("top_p", top_p, torch.float32),
                           ("temperature", temperature, torch.float32)):
        if t is not None and (t.shape != (num_rows,) or t.dtype != dtype or t.device != device
                              or (num_rows > 1 and t.stride(0) != 1)):
            raise ValueError(f"{name} must be a contiguous {dtype} [{num_rows}] tensor on {device}, got "
                             f"{t.dtype} {list(t.shape)} stride {t.stride()} on {t.device}")
    if top_k is not None and not 0 < max_top_k:
        raise ValueError(f"max_top_k must be the largest k (> 0) when top_k is given, got {max_top_k}")
    out = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0:
        return out
    if vocab == 0:
        raise ValueError("logits must have at least one column")
    scale = (lambda v: v.float()) if temperature is None else (lambda v: v.float() / temperature.unsqueeze(1))
    if top_k is None and top_p is None and num_rows < _RACE_MIN_ROWS:
        return argmax_rows(scale(logits).softmax(-1) / noise)
    # The k-th largest value of the rows with top-k on (x / t keeps the order, and rounds as the
    # kernel's division does); k <= 0 gathers a value the kernel ignores. What is off passes a
    # stand-in of its pointer's type (noise: fp32, out: int64), never read (has_* 0).
    kth = noise
    if top_k is not None:
        width = min(max_top_k, vocab)
        kth = scale(logits.topk(width, dim=-1).values.gather(1, top_k.clamp(1, width).unsqueeze(1) - 1)).squeeze(1)
    _race_sample_kernel[(num_rows,)](logits, noise, kth, out if top_k is None else top_k,
                                     noise if top_p is None else top_p,
                                     noise if temperature is None else temperature, out, vocab,
                                     logits.stride(0), noise.stride(0), int(top_k is not None),
                                     int(top_p is not None), int(temperature is not None),
                                     BLOCK=block or config_for(num_rows)[0],
                                     num_warps=num_warps or config_for(num_rows)[1])
    return out


def warm_up(num_cols: int, device: torch.device | str, dtypes=(torch.float32,)) -> None:
    """Compile each variant race_sample picks for rows of num_cols logits of each of `dtypes`
    (one per config_for and dtype), so that none compiles while serving."""
    top_p = torch.ones(1, dtype=torch.float32, device=device)        # a cut (off), so the kernel runs
    noise = torch.ones(1, num_cols, dtype=torch.float32, device=device)
    for dtype in dict.fromkeys(dtypes):
        x = torch.zeros(1, num_cols, dtype=dtype, device=device)
        for num_rows in (1, _MANY_ROWS):
            block, num_warps = config_for(num_rows)
            race_sample(x, noise, None, top_p, block=block, num_warps=num_warps)


def race_sample_ref(logits: torch.Tensor, noise: torch.Tensor, top_k: torch.Tensor | None,
                    top_p: torch.Tensor | None) -> torch.Tensor:
    """[B] int64: the kept token with the largest p / q (module docstring), by the sort."""
    if top_k is not None or top_p is not None:
        logits = keep_top_k_top_p(logits, top_k, top_p)
    return (logits.softmax(-1) / noise).argmax(-1)


def keep_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the logits >= the k-th largest (its ties too, as vLLM and HF do), then the smallest
    prefix of those (by probability, renormalized over the survivors) whose mass reaches top_p;
    the rest become -inf.

    Works on the descending stable sort, so top-p keeps ties lowest id first.
    """
    num_rows, vocab_size = logits.shape
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)   # [B, V]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)
        kth = sorted_logits.gather(1, k.unsqueeze(1) - 1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(-1)
        # Mass strictly before each position: keep a token while that is still below top_p.
        mass_before = torch.cat([probs.new_zeros(num_rows, 1), probs.cumsum(-1)[:, :-1]], dim=1)
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)
