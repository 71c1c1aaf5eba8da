"""scripts/profile_step.py on CPU with the tiny model: its closed loop, and the shared-prefix
workload (a served engine's steps in process)."""
import os
import random
import sys

import pytest

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from scripts.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))       # the script imports bench_common so
import profile_step  # noqa: E402



@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", arch="llama", seed=3))


def make_core(model: str) -> EngineCore:
    return EngineCore(EngineConfig(model=model, dtype="float32", device="cpu",
                                   max_num_seqs=8, max_model_len=128))


def test_requests_in_a_group_share_their_prefix_from_the_cache(tiny):
    core = make_core(tiny)
    sc = profile_step.parse_scenario("8x10x4j")
    row = profile_step.closed_loop(core, sc, vocab=1000, num_steps=30, warm_steps=10,
                                   rng=random.Random(0), shared_prefix=32, group_size=4)
    stats = core.get_stats()
    assert row["output_tok_s"] > 0 and row["steps"] == 30
    # Each request after its group's first finds the 32-token prefix (2 blocks) cached, and
    # the group's members decode through cascade attention.
    requests = stats.num_prompt_tokens // (32 + 10)
    assert stats.num_cached_prompt_tokens >= 32 * (requests * 3 // 4 - 2), stats
    assert stats.num_cascade_rows > 0, stats


def test_without_a_shared_prefix_nothing_is_found_in_the_cache(tiny):
    core = make_core(tiny)
    profile_step.closed_loop(core, profile_step.parse_scenario("8x40x4"), vocab=1000,
                             num_steps=20, warm_steps=5, rng=random.Random(0))
    assert core.get_stats().num_cached_prompt_tokens == 0
