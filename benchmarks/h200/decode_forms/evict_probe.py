"""One-off (thirty-first session): the plain decode kernel with cache hints on its K/V loads, against
the kernel as it is, 32 layers' calls in a CUDA graph, us a layer (decode_attention_forms.md's
timing). The K/V tiles are read once a call, so an L2 line they fill is never read again:
eviction_policy="evict_first" (and/or cache_modifier=".cg") may leave L2 and the DRAM queue to
what is reused. Each variant is kernels/paged_attention.py with the four K/V loads of `_kv_at`
rewritten, imported from a temporary file; its outputs must equal the plain kernel's bits.

    PYTHONPATH=. python3 benchmarks/h200/decode_forms/evict_probe.py $OUT/evict.json
    PYTHONPATH=. python3 benchmarks/h200/decode_forms/evict_probe.py --cpu-check   # TRITON_INTERPRET=1
"""
import importlib.util
import json
import os
import random
import sys
import tempfile

LOADS = ["k = tl.load(k_ptrs, mask=k_mask, other=0.0)", "v = tl.load(v_ptrs, mask=k_in[:, None], other=0.0)",
         "k = tl.load(k_ptrs)", "v = tl.load(v_ptrs)"]
HINTS = {"evict_first": 'eviction_policy="evict_first"', "cg": 'cache_modifier=".cg"',
         "evict_first_cg": 'eviction_policy="evict_first", cache_modifier=".cg"'}


def variant(name: str):
    """kernels/paged_attention.py with the hint on _kv_at's K/V loads, as a module."""
    src = open(os.path.join(os.path.dirname(__file__), "..", "..", "..", "kernels", "paged_attention.py")).read()
    for load in LOADS:
        assert src.count(load) == 1, load
        src = src.replace(load, load[:-1] + (", " if "mask" in load else "") + HINTS[name] + ")")
    path = os.path.join(tempfile.mkdtemp(), f"paged_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"paged_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod        # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main():
    cpu = "--cpu-check" in sys.argv
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import kernels.paged_attention as pa
    import scripts.gpu_check_cascade as gcc
    from scripts.gpu_check_attention import D
    if cpu:
        gcc.DEVICE, gcc.DTYPE = "cpu", torch.float32
    mods = {name: variant(name) for name in HINTS}
    rng = random.Random(0)
    if cpu:
        cases = [("mixed", [rng.randrange(20, 90) for _ in range(5)])]
    else:
        cases = [("equal 1500", [1500] * 256), ("mixed 1000-2000", [rng.randrange(1000, 2001) for _ in range(256)]),
                 ("mixed 1000-2000", [rng.randrange(1000, 2001) for _ in range(512)]),
                 ("mixed 1000-2000", [rng.randrange(1000, 2001) for _ in range(128)])]
    rows = []
    for tag, lens in cases:
        b = gcc.Batch([], [(1, L) for L in lens], seed=len(lens) + sum(lens) % 1000)
        scale = D ** -0.5

        def call(mod, out):
            return lambda: mod.paged_attention(b.q, b.k, b.v, b.table, b.cu, b.lens, scale, max_seqlen_q=1,
                                               max_seqlen_k=max(lens), merge_in_kernel=True, out=out)
        ref = torch.empty_like(b.q)
        call(pa, ref)()
        r = {"case": tag, "rows": len(lens), "gb": sum(lens) * 8 * D * 2 * 2 / 1e9}
        if not cpu:
            import triton.testing
            from scripts.bench_common import capture_graph

            def timed(fn):
                graph, _ = capture_graph(lambda: [fn() for _ in range(32)])
                us = triton.testing.do_bench(graph.replay, warmup=20, rep=100, return_mode="median") * 1e3 / 32
                del graph
                return us
        for name, mod in [("plain", pa)] + list(mods.items()):
            out = torch.empty_like(b.q)
            fn = call(mod, out)
            fn()
            same = bool(torch.equal(out, ref))
            r[name] = {"same_bits": same}
            if not cpu:
                r[name]["us"] = [timed(fn) for _ in range(2)]
                r[name]["tbs"] = r["gb"] / min(r[name]["us"]) * 1e3
        print(json.dumps(r), flush=True)
        rows.append(r)
        assert all(r[n]["same_bits"] for n in ["plain"] + list(HINTS)), r
    if not cpu:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
