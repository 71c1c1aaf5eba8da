"""scripts/gpu_gemm_rate.py's projection shapes (the timing itself needs a GPU)."""
from scripts.bench_common import PRESETS
from scripts.gpu_gemm_rate import layer_shapes


def test_layer_shapes_are_the_fused_projections():
    shapes = layer_shapes(PRESETS["llama-3.1-8b"])
    assert shapes == {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096),
                      "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}
    # With the lm_head and the embedding, 32 such layers are the preset's parameters.
    cfg = PRESETS["llama-3.1-8b"]
    per_layer = sum(n * k for n, k in shapes.values()) + 2 * cfg["hidden_size"]
    total = 32 * per_layer + 2 * cfg["vocab_size"] * cfg["hidden_size"] + cfg["hidden_size"]
    assert total == 8_030_261_248
