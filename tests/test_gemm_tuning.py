"""engine/gemm_tuning.py: the rule that keeps cuBLAS unless the Triton kernel is clearly faster
(CPU), and on a GPU the start-up timing over a model's projections."""
import pytest
import torch

from engine.gemm_tuning import MARGIN, pick
from kernels.skinny_gemm import SkinnyConfig
from tests.kernel_support import ON_GPU


def test_pick_needs_the_margin():
    a, b = SkinnyConfig(64, 128, 2), SkinnyConfig(64, 256, 1)
    assert pick(10.0, {}) is None
    assert pick(10.0, {a: 9.0, b: 9.5}) == a
    assert pick(10.0, {a: 10.0 * (1 - MARGIN) + 1e-6}) is None      # within noise of cuBLAS
    assert pick(10.0, {a: 12.0, b: 11.0}) is None
    assert 0 < MARGIN < 0.1


@pytest.mark.skipif(not ON_GPU, reason="times CUDA graphs")
def test_tuning_fills_every_layers_tables_by_the_rule(tmp_path):
    from engine.gemm_tuning import tune_skinny_gemms
    from engine.models.attention import triton_backend
    from engine.models.linear import ROW_BUCKETS
    from engine.models.loader import load_model
    from tests.test_models import save_llama_config_only
    save_llama_config_only(tmp_path)
    model, config = load_model(tmp_path, torch.bfloat16, "cuda", load_format="dummy",
                               attention_backend=triton_backend(), fused_kernels=True)
    report = tune_skinny_gemms(model, torch.device("cuda"))
    projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert [(r["proj"], r["rows"], r["silu_mul"]) for r in report] == (
        [(p, m, False) for p in projections for m in ROW_BUCKETS] + [("down_proj", m, True) for m in ROW_BUCKETS]
        + [("lm_head", m, False) for m in ROW_BUCKETS])
    owner = {"qkv_proj": lambda l: l.self_attn.qkv_proj, "o_proj": lambda l: l.self_attn.o_proj,
             "gate_up_proj": lambda l: l.mlp.gate_up_proj, "down_proj": lambda l: l.mlp.down_proj,
             "lm_head": lambda l: model.lm_head}
    for r in report:
        times = r["triton_us"]
        best = min(times, key=times.get)
        assert r["best"] == best and all(t > 0 for t in times.values()) and r["baseline_us"] > 0
        assert (r["chosen"] != "baseline") == (times[best] < (1 - MARGIN) * r["baseline_us"])
        for layer in model.layers:
            lin = owner[r["proj"]](layer)
            table = lin.skinny_silu if r["silu_mul"] else lin.skinny
            assert r["chosen"] == ("triton " + str(table[r["rows"]]) if r["rows"] in table else "baseline")
