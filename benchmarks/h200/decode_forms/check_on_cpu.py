"""The probe kernels here against their references under Triton's interpreter (CPU, float32):
mixed context lengths, GQA, a sliding window, padding rows (NaN-poisoned), a row with no query,
and program / split counts that cut items. Run from the repository root:

    python3 benchmarks/h200/decode_forms/check_on_cpu.py
"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from kernels.attention_ref import paged_attention_ref  # noqa: E402
from page_decode import page_decode_attention  # noqa: E402
from stream_decode import stream_decode_attention  # noqa: E402
from tile_gemm import TileConfig, candidate_configs, tile_gemm  # noqa: E402
from tests.test_paged_attention import make_batch  # noqa: E402

CTX = [5, 70, 1, 100, 33, 16, 17, 200]
worst = {"stream": 0.0, "page": 0.0}
for hq, hkv, d, window, bs in [(4, 4, 32, None, 16), (4, 2, 16, 7, 16), (8, 2, 64, None, 32), (8, 2, 64, 20, 16)]:
    for n in (1, 3, 7, 50):
        args = make_batch([1] * len(CTX), CTX, hq, hkv, d, bs, torch.float32, seed=n)
        ref = paged_attention_ref(*args, d ** -0.5, window)
        for name, run in (("stream", lambda o: stream_decode_attention(*args, o, d ** -0.5, window, block_n=16,
                                                                      programs=n, seqs=2 if n % 2 else 16)),
                          ("page", lambda o: page_decode_attention(*args, o, d ** -0.5, window,
                                                                  num_kv_splits=1 + n % 5, keys=4 + 12 * (n % 2)))):
            out = torch.full(args[0].shape, float("nan"))
            run(out)
            err = (out - ref).abs().max().item()
            assert err < 1e-4, (name, hq, hkv, d, window, bs, n, err)
            worst[name] = max(worst[name], err)
args = make_batch([1, 0, 1], [5, 3, 70], 4, 2, 16, 16, torch.float32, seed=1)
ref = paged_attention_ref(*args, 0.25, None)
for name, run in (("stream", lambda o: stream_decode_attention(*args, o, 0.25, None, block_n=16, programs=5)),
                  ("page", lambda o: page_decode_attention(*args, o, 0.25, None, num_kv_splits=3))):
    out = torch.full(args[0].shape, float("nan"))
    run(out)
    worst[name] = max(worst[name], (out - ref).abs().max().item())
print("largest |difference| from the reference:", worst)

gen = torch.Generator().manual_seed(0)
gemm_worst = 0.0
for c in candidate_configs() + [TileConfig(64, 64, 64, 4, 3, 3)]:
    for m, n, k in [(5, 200, 100), (70, 128, 256), (128, 300, 192)]:
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        err = (tile_gemm(x, w, c) - x @ w.T).abs().max().item()
        assert err < 1e-3, (str(c), m, n, k, err)
        gemm_worst = max(gemm_worst, err)
print("tile_gemm, largest |difference| from x @ w.T:", gemm_worst)
