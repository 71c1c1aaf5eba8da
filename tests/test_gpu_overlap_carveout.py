"""scripts/gpu_overlap_carveout.py's arithmetic (the probe itself needs a GPU: its results are in
benchmarks/h200/overlap_carveout.md)."""
import argparse

import pytest

from scripts.gpu_overlap_carveout import bytes_floor_ms, gemm_flops, parse_pair, summarize


def test_pairs_parse_and_bad_ones_name_the_form():
    assert parse_pair("256:2048") == (256, 2048)
    for bad in ("256", "256:", ":8", "0:8", "a:b", "256x2048"):
        with pytest.raises(argparse.ArgumentTypeError, match="ATTN_ROWS:GEMM_ROWS"):
            parse_pair(bad)


def test_floor_and_flops_at_the_8b_shape():
    # 32 layers of 6.98e9 weight parameters in the four projections: 13.96 GFLOP a row.
    assert gemm_flops(1) == pytest.approx(13.96e9, rel=1e-3)
    # 256 rows x 1620 keys x 128 KiB of K/V a token (32 layers) = 54.4 GB, weights 13.96 GB.
    assert bytes_floor_ms(256, 2048, 1620) == pytest.approx((54.36e9 + 13.96e9) / 4.28e12 * 1e3, rel=1e-3)
    # Weights do not depend on the GEMM's rows; K/V grows with the attention's.
    assert bytes_floor_ms(256, 8192, 1620) == bytes_floor_ms(256, 2048, 1620)
    assert bytes_floor_ms(512, 2048, 1620) > bytes_floor_ms(256, 2048, 1620)


def test_gain_is_serial_over_streams():
    row = summarize({"serial_ms": 30.0, "streams_ms": 24.0, "carveout": 32})
    assert row["gain"] == pytest.approx(1.25) and row["carveout"] == 32
