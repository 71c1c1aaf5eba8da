"""tma_gemm.py's forms against F.linear (cuBLAS) for a Llama-8B layer's projections at 256-512
rows: each config checked against F.linear (and the stream-K form for the same bits twice), then
timed as a CUDA graph over 32 layers' own weights (HBM), us a call. Each config runs in a child
process under a time limit (the stream-K form spins on flags: a bug there would hang the GPU).
Twenty-fifth session. The first call (fcaad8c) ran a child a form, every config of CONFIGS;
the second a child a config, PLAN.

    PYTHONPATH=. python3 benchmarks/h200/decode_forms/tma_gemm_probe.py --out $OUT/tma_gemm.json
    python3 benchmarks/h200/decode_forms/tma_gemm_probe.py --cpu-check     # interpreter, float32
"""
import argparse
import json
import os
import subprocess
import sys
import time

if "--cpu-check" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
from tma_gemm import GemmConfig, tma_gemm  # noqa: E402

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
          "down_proj": (4096, 14336)}
LAYERS = 32
CONFIGS = {
    "dp": [(128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 256, 64, 4, 4), (128, 128, 64, 8, 4)],
    "dp_wsk": [(128, 256, 64, 4, 3), (128, 128, 64, 4, 4), (128, 128, 128, 4, 3)],
    "tile_wsk": [(128, 256, 64, 4, 3), (128, 128, 64, 4, 4), (64, 256, 64, 4, 3)],
    "sk": [(128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (64, 256, 64, 4, 4)],
}
# The second call (one child a config, the warp-specialized ones last: they hung in the first).
PLAN = ["cublas", "dp/128x256x64/w8/s3", "sk/128x256x64/w8/s3", "sk/128x128x64/w4/s4", "sk/64x256x64/w4/s4",
        "tile_wsk/128x128x64/w4/s4", "dp_wsk/128x128x64/w4/s4", "tile_wsk/128x256x64/w4/s3"]
TOLERANCE = 0.125   # against an fp32 product; outputs reach ~2.5, where a bf16 step is 1/64


def parse(config: str) -> GemmConfig:
    form, tile, w, s = config.split("/")
    bm, bn, bk = map(int, tile.split("x"))
    return GemmConfig(form, bm, bn, bk, int(w[1:]), int(s[1:]))


def cpu_check() -> None:
    torch.manual_seed(0)
    for m, n, k, progs in [(32, 96, 64, 5), (48, 80, 96, 3), (16, 32, 512, 8), (32, 64, 400, 7)]:
        x, w = torch.randn(m, k), torch.randn(n, k)
        ref = x @ w.T
        for form in CONFIGS:
            y = tma_gemm(x, w, GemmConfig(form, 16, 32, 16, 4, 2), num_programs=progs)
            diff = float((y - ref).abs().max())
            print(f"{m}x{n}x{k} {form:9} programs {progs}: max diff {diff:.1e}")
            assert diff < 1e-3, form


def child(config: str, rows_list: list[int]) -> None:
    """One config (or "cublas": F.linear) over every projection and row count, a ROW line each."""
    from engine.gemm_tuning import replay_ms
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(LAYERS)]
        for rows in rows_list:
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=gen)
            ref = x.float() @ weights[0].float().T
            flops = 2 * rows * n * k
            row = dict(proj=name, rows=rows, config=config)
            if config == "cublas":
                fn = F.linear
            else:
                c = parse(config)
                fn = lambda x, w: tma_gemm(x, w, c)        # noqa: E731
            try:
                y, y2 = fn(x, weights[0]), fn(x, weights[0])
                torch.cuda.synchronize()
                row["max_diff"] = float((y.float() - ref).abs().max())
                row["same_bits_twice"] = bool(torch.equal(y, y2))
                row["equals_cublas_bits"] = bool(torch.equal(y, F.linear(x, weights[0])))
                if not row["max_diff"] <= TOLERANCE or not row["same_bits_twice"]:
                    row["error"] = "differs from the fp32 product or from itself"
                else:
                    row["us"] = replay_ms(lambda: [fn(x, w) for w in weights], dev) * 1e3 / LAYERS
                    row["tflops"] = flops / row["us"] / 1e6
            except Exception as e:      # a config that does not compile is a result here
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print("ROW " + json.dumps(row), flush=True)
        del weights
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 384, 512])
    ap.add_argument("--configs", nargs="+", default=PLAN)
    ap.add_argument("--timeout-s", type=float, default=75, help="a child's limit")
    ap.add_argument("--out")
    ap.add_argument("--cpu-check", action="store_true")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.cpu_check:
        cpu_check()
        return
    if args.child:
        child(args.child, args.rows)
        return
    from scripts.bench_common import git_commit, hardware
    result = {"hardware": hardware(), "commit": os.environ.get("BENCH_COMMIT") or git_commit(),
              "command": " ".join(sys.argv), "rows": []}
    for form in args.configs:
        t0 = time.time()
        try:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", form, "--rows",
                                   *map(str, args.rows)], capture_output=True, text=True, timeout=args.timeout_s)
            out, err, rc = done.stdout, done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:
            out, err, rc = (e.stdout or b"").decode(), (e.stderr or b"").decode(), "timeout"
        rows = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
        result["rows"] += rows
        result.setdefault("children", []).append(dict(form=form, rc=rc, s=time.time() - t0, stderr_tail=err[-1500:]))
        print(f"config {form}: rc {rc}, {len(rows)} rows, {time.time() - t0:.0f} s", flush=True)
        if args.out:
            json.dump(result, open(args.out, "w"), indent=1)
    base = {(r["proj"], r["rows"]): r["us"] for r in result["rows"] if r["config"] == "cublas"}
    for (proj, rows), us in base.items():
        cands = [r for r in result["rows"] if r["proj"] == proj and r["rows"] == rows and "us" in r
                 and r["config"] != "cublas"]
        best = min(cands, key=lambda r: r["us"], default=None)
        print(f"{proj:13} {rows:4d}: cuBLAS {us:7.1f} us | best {best and best['config']} "
              f"{best and round(best['us'], 1)} us ({best and round(us / best['us'], 3)}x)")


if __name__ == "__main__":
    main()
