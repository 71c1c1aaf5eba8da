"""engine/cascade_step.py: a step's cascade metadata (the planner: tests/test_cascade_plan.py)."""
from types import SimpleNamespace

import numpy as np
import torch

from engine.cascade_step import SPLITS, CascadeStep, CascadeSteps, own_rows


def step(q_lens, prefix_lens):
    q_lens = np.asarray(q_lens, dtype=np.int32)
    members = int((np.asarray(prefix_lens) > 0).sum())
    return CascadeStep(list(range(len(q_lens))), np.asarray(prefix_lens, dtype=np.int32),
                       np.asarray([0, members], dtype=np.int32), 16, 32, 1, 2, own_rows(q_lens))


def test_prompt_prefixes_says_whether_a_prompt_row_reads_a_prefix():
    # Decode members beside lone prompt chunks (a shared-prefix job's prompt steps): no.
    assert step([1, 1, 40, 7], [32, 32, 0, 0]).prompt_prefixes is False
    # A prompt chunk in the group: yes.
    assert step([1, 40, 1], [32, 32, 0]).prompt_prefixes is True
    # One kind of row only (no launch apart): the single launch keeps the fold.
    assert step([1, 1, 1], [32, 32, 0]).prompt_prefixes is True
    assert step([5, 40], [32, 32]).prompt_prefixes is True


def test_metadata_carries_it_with_the_launches_apart():
    meta = SimpleNamespace(prompt_prefixes=True)
    step([1, 1, 40], [32, 32, 0]).fill_metadata(meta, torch.device("cpu"))
    assert meta.prompt_prefixes is False
    assert meta.own_prompt_seqs.tolist() == [2] and meta.own_decode_seqs.tolist() == [0, 1]
    meta = SimpleNamespace(prompt_prefixes=True)
    step([1, 40, 1], [32, 32, 0]).fill_metadata(meta, torch.device("cpu"))
    assert meta.prompt_prefixes is True


def test_warm_up_compiles_the_prompt_tiles_with_and_without_the_fold():
    """The eager variants the runner compiles at start (GPU only): for every split count, a
    prompt launch with the fold and one without, so neither compiles mid-serving."""
    config = SimpleNamespace(sliding_window=None, sliding_window_layers=None, num_attention_heads=8,
                             num_key_value_heads=2, head_dim=32)
    steps = CascadeSteps(config, torch.bfloat16, torch.bfloat16, 16, torch.device("cuda"), True)
    seen = {(s.num_prefix_splits, s.own_rows is not None, s.prompt_prefixes)
            for _, _, s in steps.warm_up_steps()}
    for splits in SPLITS:
        assert {(splits, True, True), (splits, True, False), (splits, False, True)} <= seen
    assert not list(CascadeSteps(config, torch.float32, torch.float32, 16, torch.device("cpu"),
                                 True).warm_up_steps())
