"""scripts/gpu_check_cascade.py's sweep options (the sweep itself needs a GPU: its results are in
benchmarks/h200/cascade_decode_passes.md)."""
import pytest

from scripts.gpu_check_cascade import decode_groups, parse_tiles


def test_tiles_parse_as_keys_warps_stages():
    assert parse_tiles(["64x4x2", "32x2x3"]) == ((64, 4, 2), (32, 2, 3))


@pytest.mark.parametrize("bad", [["64x4"], ["64x4x2x1"], ["64x0x2"], ["64xfourx2"]])
def test_malformed_tiles_are_refused(bad):
    with pytest.raises(ValueError):
        parse_tiles(bad)


def test_sweep_rows_make_whole_groups():
    groups = decode_groups(16, 2000, num_rows=512)
    assert len(groups) == 32
    assert all(prefix == 2000 and len(members) == 16 for prefix, members in groups)
