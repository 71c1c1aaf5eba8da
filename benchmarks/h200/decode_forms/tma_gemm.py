"""A probe, not used by the engine: a persistent GEMM with TMA loads for 256-512 rows, in a few
forms, y = x @ W^T (F.linear without bias). Twenty-fifth session.

Why: at 256 rows cuBLAS runs a Llama-8B layer's projections at ~622 TFLOP/s against ~742 at 512
rows (H200). gate_up_proj makes 224 tiles of 128 x 256 for 132 SMs: 1.7 waves, the second 70%
full. tile_gemm.py (pointer loads, one program a tile) ran 15-45% slower than cuBLAS; its note
says it lacked TMA and warp specialization. These forms have both, and the third balances the
last wave:

- "dp": one program an SM, looping over whole tiles (the M tiles of one N tile next to each
  other, so W's tile comes from L2 the second time); TMA descriptors made on the host.
- "dp_ws": the same loop with `warp_specialize=True`. Compiled for sm_90 (the CPU machine, with
  scripts/sm90_target.py), triton 3.6 does not partition it: it runs as "dp". Not timed.
- "sk" (stream-K, hybrid): the tiles of every full wave but the last are whole tiles as in "dp";
  the rest, tiles x K steps, are cut into one equal run of K steps per program. A program that
  starts a tile (holds its first K step) adds the partials of the programs after it on that
  tile, in program order, so the bits do not depend on timing; a program that starts inside a
  tile stores its fp32 partial in its own slot and raises its flag. Every program is resident
  (one an SM, the grid is the SM count). (The session's first form had the tile's last K step
  own it: each owner then waited at the start of its run for the end of the run before it, a
  chain through every program: 4-40x slower than cuBLAS, tma_gemm_fcaad8c.json.)
- "dp_wsk" / "tile_wsk": the K loop warp-specialized, persistent or one program a tile (on
  sm_90 triton 3.6 partitions only a K loop at 4 warps: a TMA producer and two consumer warp
  groups, 12 warps; compiled on the CPU machine; the output is stored with pointers, as a
  descriptor store after the loop fails to compile). On the H200 every config of both timed out
  (hung), in both calls.

On the H200 cuBLAS was faster at every shape (benchmarks/h200/tma_gemm.md).

Math: fp32 accumulation, rounded once to x's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["GemmConfig", "tma_gemm", "FORMS"]

FORMS = ("dp", "dp_ws", "dp_wsk", "tile_wsk", "sk")


@dataclass(frozen=True)
class GemmConfig:
    form: str
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.form}/{self.block_m}x{self.block_n}x{self.block_k}/w{self.num_warps}/s{self.num_stages}"


@triton.jit
def _whole_tile(a_desc, b_desc, c_desc, pm, pn, k_tiles, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr):
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(k_tiles):
        a = a_desc.load([pm * BM, ki * BK])
        b = b_desc.load([pn * BN, ki * BK])
        acc = tl.dot(a, b.T, acc)
    c_desc.store([pm * BM, pn * BN], acc.to(c_desc.dtype))


@triton.jit(do_not_specialize=["M"])
def _gemm_dp(a_desc, b_desc, c_desc, c_ptr, M, N, K, NUM_PROGS: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr, WS: tl.constexpr, WSK: tl.constexpr):
    num_m = tl.cdiv(M, BM)
    tiles = num_m * tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGS, flatten=WS, warp_specialize=WS):
        pm = tile % num_m
        pn = tile // num_m
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in tl.range(0, k_tiles, warp_specialize=WSK):
            a = a_desc.load([pm * BM, ki * BK])
            b = b_desc.load([pn * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        if WSK:     # triton 3.6 fails a descriptor store after a warp-specialized loop on sm_90
            offs_m = pm * BM + tl.arange(0, BM)
            offs_n = pn * BN + tl.arange(0, BN)
            tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                     mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
        else:
            c_desc.store([pm * BM, pn * BN], acc.to(c_desc.dtype))


@triton.jit(do_not_specialize=["M"])
def _gemm_sk(a_desc, b_desc, c_desc, part_ptr, flag_ptr, M, N, K, NUM_PROGS: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, REVERSED: tl.constexpr):
    # REVERSED: the interpreter runs programs one after another, lowest first; there the ids are
    # handed out highest first, so every program a wait names has already run.
    pid = NUM_PROGS - 1 - tl.program_id(0) if REVERSED else tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    tiles = num_m * tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    # Whole tiles: every full wave but the last.
    full_waves = tiles // NUM_PROGS
    dp_tiles = tl.maximum(full_waves - 1, 0) * NUM_PROGS
    for tile in tl.range(pid, dp_tiles, NUM_PROGS):
        _whole_tile(a_desc, b_desc, c_desc, tile % num_m, tile // num_m, k_tiles, BM, BN, BK)
    # The rest, as one run of K steps a program. A run starts inside a tile (it computes that
    # tile's later K steps: a partial for the program before it) and ends with a tile's first K
    # steps (it owns that tile and adds the partials of the programs after it). A program's
    # partial is its run's first piece, done first, so an owner's wait is short.
    total = (tiles - dp_tiles) * k_tiles
    per = total // NUM_PROGS
    extra = total % NUM_PROGS
    start = pid * per + tl.minimum(pid, extra)
    end = start + per + (pid < extra).to(tl.int32)
    offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    while start < end:
        tile = dp_tiles + start // k_tiles
        k0 = start % k_tiles
        k1 = tl.minimum(k_tiles, k0 + end - start)
        pm = tile % num_m
        pn = tile // num_m
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k0, k1):
            a = a_desc.load([pm * BM, ki * BK])
            b = b_desc.load([pn * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        if k0 > 0:
            # Another program owns the tile: this program's slot, then its flag.
            tl.store(part_ptr + pid.to(tl.int64) * BM * BN + offs, acc)
            tl.debug_barrier()
            tl.atomic_xchg(flag_ptr + pid, 1, sem="release")
        else:
            # Owned: add the partials of the programs after this one, in program order.
            tile_first = start                      # the tile's first K step, in run units
            covered = k1
            q = pid + 1
            while covered < k_tiles:
                flag = tl.atomic_add(flag_ptr + q, 0, sem="acquire")
                while flag == 0:
                    flag = tl.atomic_add(flag_ptr + q, 0, sem="acquire")
                acc += tl.load(part_ptr + q.to(tl.int64) * BM * BN + offs, cache_modifier=".cg")
                tl.atomic_xchg(flag_ptr + q, 0)
                q_end = (q + 1) * per + tl.minimum(q + 1, extra)
                covered = tl.minimum(k_tiles, q_end - tile_first)
                q += 1
            c_desc.store([pm * BM, pn * BN], acc.to(c_desc.dtype))
        start += k1 - k0


_NUM_SMS: dict[int, int] = {}
_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _num_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 8                                # the interpreter's stand-in
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def tma_gemm(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig, out: torch.Tensor | None = None,
             num_programs: int | None = None) -> torch.Tensor:
    """y = x @ weight^T for x [M, K] and weight [N, K], contiguous rows of one dtype."""
    m, k = x.shape
    n, k_w = weight.shape
    if k != k_w or x.stride(1) != 1 or weight.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(f"x [M, K] and weight [N, K] of one dtype, unit column stride; got {tuple(x.shape)} "
                         f"{x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    c = config
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    a_desc = TensorDescriptor.from_tensor(x, [c.block_m, c.block_k])
    b_desc = TensorDescriptor.from_tensor(weight, [c.block_n, c.block_k])
    c_desc = TensorDescriptor.from_tensor(y, [c.block_m, c.block_n])
    progs = num_programs or _num_programs(x.device)
    tiles = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)
    if c.form in ("dp", "dp_ws", "dp_wsk", "tile_wsk"):
        grid = tiles if c.form == "tile_wsk" else min(progs, tiles)
        _gemm_dp[(grid,)](a_desc, b_desc, c_desc, y, m, n, k, NUM_PROGS=grid,
                                       BM=c.block_m, BN=c.block_n, BK=c.block_k, WS=c.form == "dp_ws",
                                       WSK=c.form in ("dp_wsk", "tile_wsk"),
                                       num_warps=c.num_warps, num_stages=c.num_stages)
    elif c.form == "sk":
        key = (x.device, progs, c.block_m, c.block_n)
        if key not in _SCRATCH:
            _SCRATCH[key] = (torch.empty(progs * c.block_m * c.block_n, dtype=torch.float32, device=x.device),
                             torch.zeros(progs, dtype=torch.int32, device=x.device))
        part, flags = _SCRATCH[key]
        _gemm_sk[(progs,)](a_desc, b_desc, c_desc, part, flags, m, n, k, NUM_PROGS=progs, BM=c.block_m,
                           BN=c.block_n, BK=c.block_k, REVERSED=x.device.type != "cuda", num_warps=c.num_warps,
                           num_stages=c.num_stages)
    else:
        raise ValueError(f"form must be one of {FORMS}, got {c.form!r}")
    return y
