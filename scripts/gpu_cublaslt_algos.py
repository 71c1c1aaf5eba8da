"""Every algorithm cuBLASLt's heuristic offers for our projections, timed one by one against
F.linear (issue 13: the 256-row decode GEMMs run at ~622 TFLOP/s against ~742 at 512 rows,
gemm_rate_3724bbd.json; issue 12: the prompt steps' 8,192-row GEMMs). cuBLASLt is called
through ctypes (torch exposes only its top pick, torch.backends.cuda.preferred_blas_library).

An earlier form of this probe, every algorithm in one process, left the device machine
unanswering (decode_attention_forms.md). Here each (rows, projection) runs in a child process
of its own under a time limit; an algorithm that fails its check against F.linear is reported
and not timed. Times are a CUDA graph of the projection over `--layers` layers' own weights
(HBM, not L2), median of 7 replays, as scripts/gpu_gemm_rate.py times F.linear.

    python3 scripts/gpu_cublaslt_algos.py --rows 256 384 8192 --out $OUT/cublaslt_algos.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# cuBLASLt's enums and attribute ids (cublasLt.h, library_types.h).
CUBLAS_COMPUTE_32F = 68
CUDA_R_32F = 0
CUDA_R_16BF = 14
CUBLAS_OP_T = 1
DESC_TRANSA = 3
PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE_BYTES = 32 << 20          # what torch gives cuBLAS on Hopper


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def gemm_operands(rows: int, n: int, k: int) -> dict:
    """F.linear(x [rows, k], w [n, k]) -> out [rows, n] in cuBLAS's column-major terms, as torch
    calls it: out^T (n x rows) = op_T(w^T as k x n, ld k) @ x^T (k x rows, ld k)."""
    return {"a": (k, n, k), "b": (k, rows, k), "c": (n, rows, n), "transa": CUBLAS_OP_T}


def load_cublaslt() -> ctypes.CDLL:
    """The libcublasLt torch itself loaded (read from this process's maps after a matmul)."""
    import torch
    a = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcublasLt" in line}
    if not paths:
        raise RuntimeError("torch loaded no libcublasLt")
    return ctypes.CDLL(sorted(paths)[0])


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} returned cublasStatus {status}")


def child(rows: int, n: int, k: int, layers: int, max_algos: int) -> list[dict]:
    """One (rows, n, k): F.linear's time, then each heuristic algorithm's, checked first."""
    import torch
    import torch.nn.functional as F
    from engine.gemm_tuning import replay_ms
    dev = torch.device("cuda")
    lt = load_cublaslt()
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(layers)]
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=gen)
    outs = [torch.empty(rows, n, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    workspace = torch.empty(WORKSPACE_BYTES, device=dev, dtype=torch.uint8)
    flops = 2 * rows * n * k
    rows_out = [{"algo": "F.linear", "us": replay_ms(lambda: [F.linear(x, w) for w in weights], dev) * 1e3 / layers}]

    handle = ctypes.c_void_p()
    _check(lt.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    desc = ctypes.c_void_p()
    _check(lt.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "DescCreate")
    transa = ctypes.c_int32(CUBLAS_OP_T)
    _check(lt.cublasLtMatmulDescSetAttribute(desc, DESC_TRANSA, ctypes.byref(transa), ctypes.c_size_t(4)),
           "DescSetAttribute")
    ops = gemm_operands(rows, n, k)
    layouts = {}
    for name in ("a", "b", "c"):
        lay = ctypes.c_void_p()
        r, c, ld = ops[name]
        _check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(lay), CUDA_R_16BF, ctypes.c_uint64(r), ctypes.c_uint64(c),
                                             ctypes.c_int64(ld)), "LayoutCreate")
        layouts[name] = lay
    pref = ctypes.c_void_p()
    _check(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
    ws = ctypes.c_uint64(WORKSPACE_BYTES)
    _check(lt.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                   ctypes.c_size_t(8)), "PrefSet")
    results = (HeuristicResult * max_algos)()
    returned = ctypes.c_int(0)
    _check(lt.cublasLtMatmulAlgoGetHeuristic(handle, desc, layouts["a"], layouts["b"], layouts["c"], layouts["c"],
                                             pref, max_algos, results, ctypes.byref(returned)), "GetHeuristic")
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    ref = F.linear(x, weights[0]).float()

    def matmul(w, out, algo):
        stream = ctypes.c_void_p(torch.cuda.current_stream(dev).cuda_stream)
        return lt.cublasLtMatmul(handle, desc, ctypes.byref(alpha), ctypes.c_void_p(w.data_ptr()), layouts["a"],
                                 ctypes.c_void_p(x.data_ptr()), layouts["b"], ctypes.byref(beta),
                                 ctypes.c_void_p(out.data_ptr()), layouts["c"], ctypes.c_void_p(out.data_ptr()),
                                 layouts["c"], ctypes.byref(algo), ctypes.c_void_p(workspace.data_ptr()),
                                 ctypes.c_size_t(WORKSPACE_BYTES), stream)

    for i in range(returned.value):
        res = results[i]
        row = {"algo": i, "words": [int(v) for v in res.algo.data], "workspace": int(res.workspaceSize),
               "state": int(res.state), "waves": float(res.wavesCount)}
        rows_out.append(row)
        if res.state != 0 or res.workspaceSize > WORKSPACE_BYTES:
            row["skipped"] = "state or workspace"
            continue
        status = matmul(weights[0], outs[0], res.algo)
        torch.cuda.synchronize(dev)
        if status != 0:
            row["skipped"] = f"cublasLtMatmul status {status}"
            continue
        row["max_diff"] = float((outs[0].float() - ref).abs().max())
        if row["max_diff"] > 0.05 * float(ref.abs().max()):
            row["skipped"] = "differs from F.linear"
            continue

        def body(algo=res.algo):
            for w, o in zip(weights, outs):
                matmul(w, o, algo)
        row["us"] = replay_ms(body, dev) * 1e3 / layers
    for row in rows_out:
        if "us" in row:
            row["tflops"] = flops / row["us"] / 1e6
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 384, 8192])
    ap.add_argument("--layers", type=int, default=32, help="weights per graph (8 at 4,096 rows and more)")
    ap.add_argument("--max-algos", type=int, default=32)
    ap.add_argument("--timeout-s", type=float, default=90.0, help="per (rows, projection) child")
    ap.add_argument("--out")
    ap.add_argument("--child", type=int, nargs=3, metavar=("ROWS", "N", "K"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child, args.layers, args.max_algos)), flush=True)
        return
    from scripts.bench_common import PRESETS, git_commit, hardware
    from scripts.gpu_gemm_rate import layer_shapes
    meta = {"hardware": hardware(), "commit": git_commit(),
            "command": "python3 scripts/gpu_cublaslt_algos.py " + " ".join(sys.argv[1:])}
    cases = []
    for rows in args.rows:
        layers = args.layers if rows < 4096 else min(args.layers, 8)
        for proj, (n, k) in layer_shapes(PRESETS["llama-3.1-8b"]).items():
            cmd = [sys.executable, os.path.abspath(__file__), "--child", str(rows), str(n), str(k),
                   "--layers", str(layers), "--max-algos", str(args.max_algos)]
            t0 = time.time()
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
                found = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
                algos = json.loads(found[-1][7:]) if found else None
                error = None if found else (done.stderr[-2000:] or f"exit {done.returncode}")
            except subprocess.TimeoutExpired:
                algos, error = None, f"timed out after {args.timeout_s} s"
            case = {"rows": rows, "proj": proj, "n": n, "k": k, "layers": layers, "algos": algos, "error": error,
                    "wall_s": round(time.time() - t0, 1)}
            cases.append(case)
            print(summary_line(case), flush=True)
            if args.out:                    # after every case: a run cut short keeps what it did
                with open(args.out, "w") as f:
                    json.dump({"meta": meta, "cases": cases}, f, indent=1)


def summary_line(case: dict) -> str:
    """rows, projection, F.linear's us, the heuristic's first pick, the fastest and its index."""
    head = f"M={case['rows']:5d} {case['proj']:>12}"
    if not case["algos"]:
        return f"{head}: no result ({case['error']})"
    base = case["algos"][0]["us"]
    timed = [a for a in case["algos"][1:] if "us" in a]
    if not timed:
        return f"{head}: F.linear {base:.1f} us, no algorithm timed"
    best = min(timed, key=lambda a: a["us"])
    return (f"{head}: F.linear {base:7.1f} us, heuristic #0 {timed[0]['us']:7.1f}, best #{best['algo']} "
            f"{best['us']:7.1f} ({base / best['us']:.3f}x), {len(timed)} timed of {len(case['algos']) - 1}")


if __name__ == "__main__":
    main()
