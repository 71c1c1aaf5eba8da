"""scripts/gpu_prompt_tiles.py's arithmetic and arguments (the sweep itself needs a GPU)."""
import argparse

import pytest

from scripts.gpu_prompt_tiles import CASES, CONFIGS, causal_pairs_of, parse_config


def test_causal_pairs_count_each_query_rows_visible_keys():
    # A fresh prompt of 3: 1 + 2 + 3; a chunk of 2 after 4 cached keys: 5 + 6.
    assert causal_pairs_of([], [(3, 3)]) == 6
    assert causal_pairs_of([(4, [(2, 2)])], []) == 11
    assert causal_pairs_of([(4, [(2, 2)] * 3)], [(3, 3)]) == 3 * 11 + 6


def test_configs_parse_and_the_default_is_timed_first():
    assert parse_config("128,64,8,3") == (128, 64, 8, 3)
    for bad in ("128,64,8", "128,64,8,0", "a,b,c,d", "128;64;8;3"):
        with pytest.raises(argparse.ArgumentTypeError, match="ROWS,KEYS,WARPS,STAGES"):
            parse_config(bad)
    # The first config is the outputs' reference: the kernels' own prompt tile.
    from kernels.paged_attention import _pick_config
    import torch
    tile = _pick_config(2048, 128, torch.bfloat16)
    assert CONFIGS[0] == (tile.block_q, tile.block_n, tile.num_warps, tile.num_stages) and tile.parts == 0
    assert all(len(c) == 3 for c in CASES)
