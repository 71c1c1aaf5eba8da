"""The decode path through persistent, padded buffers (replayed from CUDA graphs on a GPU, run
eagerly on CPU) must give exactly what the plain eager path gives."""
import random

import pytest

from engine import LLM, SamplingParams
from engine.cuda_graphs import graph_batch_sizes
from scripts.make_tiny_model import make_tiny_model


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(256)[-3:] == [240, 248, 256]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", arch="qwen2", seed=5))


def test_padded_decode_equals_eager(model_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(1, 40))] for _ in range(11)]
    # Different lengths: the batch shrinks 11 -> 1 and crosses padding sizes 16, 8, 4, 2, 1.
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True)
              for i in range(11)]
    seeded = SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    results = {}
    for eager in (True, False):
        llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=128,
                  max_num_seqs=12, enforce_eager=eager)
        assert (llm.core.runner.decode_graphs is None) == eager
        outs = llm.generate(prompts + [prompts[0]], params + [seeded])
        results[eager] = [o.outputs[0].token_ids for o in outs]
        stats = llm.get_stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert results[True] == results[False]
