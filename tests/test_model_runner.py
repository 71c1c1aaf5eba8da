"""ModelRunner pieces that the engine tests do not reach on CPU."""
from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from scripts.make_tiny_model import make_tiny_model


def test_warm_up_runs_a_mixed_step_and_every_sampler_path(tmp_path):
    """The GPU runner warms up at start (tests/test_gpu_engine.py checks that nothing compiles
    later); on CPU it is skipped at start, so run it here: same code path, torch kernels."""
    import torch
    model = str(make_tiny_model(tmp_path / "m", arch="llama", seed=1))
    config = EngineConfig(model=model, dtype="float32", device="cpu", num_kv_blocks=16)
    runner = ModelRunner(config, torch.device("cpu"), torch.float32, [1])
    runner.allocate_kv_cache(16, 256)
    before = [k.clone() for k, _ in runner.kv_caches]
    runner._warm_up()
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, runner.kv_caches))  # no KV write
