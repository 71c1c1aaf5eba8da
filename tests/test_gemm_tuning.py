"""engine/gemm_tuning.py: the rule that keeps cuBLAS unless the Triton kernel is clearly faster
(CPU), and on a GPU the start-up timing over a model's projections."""
import pytest
import torch

from types import SimpleNamespace

from engine.gemm_tuning import CHAIN_MARGIN, MARGIN, pick, pick_chain, unmerged_in_chain
from kernels.skinny_gemm import SkinnyConfig, num_k_slices
from tests.kernel_support import ON_GPU


def test_pick_needs_the_margin():
    a, b = SkinnyConfig(64, 128, 2), SkinnyConfig(64, 256, 1)
    assert pick(10.0, {}) is None
    assert pick(10.0, {a: 9.0, b: 9.5}) == a
    assert pick(10.0, {a: 10.0 * (1 - MARGIN) + 1e-6}) is None      # within noise of cuBLAS
    assert pick(10.0, {a: 12.0, b: 11.0}) is None
    assert 0 < MARGIN < 0.1


def test_pick_chain_takes_the_fewest_k_slices_among_near_ties():
    k = 4096
    s2, s3, s5 = (SkinnyConfig(64, 128, s, 4, 4) for s in (2, 3, 5))
    wide = SkinnyConfig(32, 256, 3, 4, 3)
    assert [num_k_slices(k, c) for c in (s2, s3, s5, wide)] == [2, 3, 5, 3]
    near = 10.0 * (1 + CHAIN_MARGIN) - 1e-6
    assert pick_chain({s5: 10.0, s3: near, s2: 10.5}, k) == s3         # s2 is past the margin
    assert pick_chain({s5: 10.0, s3: near, s2: near}, k) == s2
    assert pick_chain({s5: 10.0, s3: 11.0}, k) == s5                      # no tie: the fastest
    assert pick_chain({wide: 10.1, s3: 10.0, s5: 9.95}, k) == s3          # same slices: the faster
    assert 0 < CHAIN_MARGIN < MARGIN


def test_unmerged_in_chain_follows_the_model():
    assert unmerged_in_chain(SimpleNamespace(late_merge=False, fuse_rope_kv_write=True)) == frozenset()
    assert unmerged_in_chain(SimpleNamespace(late_merge=True, fuse_rope_kv_write=True)) == {
        "qkv_proj", "o_proj", "down_proj"}
    assert unmerged_in_chain(SimpleNamespace(late_merge=True, fuse_rope_kv_write=False)) == {"o_proj", "down_proj"}


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
    model.late_merge = True
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
            if not r["silu_mul"]:       # the chain's config: timed in the chain's form, by pick_chain
                assert r["chain"] == str(lin.skinny_chain[r["rows"]])
                unmerged = r["proj"] in ("qkv_proj", "o_proj", "down_proj")
                assert r["chain_form"] == ("unmerged" if unmerged else "merged")
                chain_us = r["chain_us"]
                assert chain_us[r["chain"]] <= (1 + CHAIN_MARGIN) * min(chain_us.values())
