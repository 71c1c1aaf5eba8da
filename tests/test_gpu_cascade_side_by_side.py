"""scripts/gpu_cascade_side_by_side.py's arguments (the timing itself needs a GPU; the two forms'
equality is tests/test_cascade_attention.py's)."""
import argparse

import pytest

from scripts.gpu_cascade_side_by_side import CASES, parse_case


def test_cases_parse_and_are_whole_pages_in_whole_groups():
    assert parse_case("256,16,2000,250") == (256, 16, 2000, 250)
    for bad in ("256,16,2000", "256,16,2000,0", "a,b,c,d", "256;16;2000;250"):
        with pytest.raises(argparse.ArgumentTypeError, match="ROWS,GROUP,PREFIX,OWN"):
            parse_case(bad)
    # gpu_check_cascade.Batch stores a prefix in whole 16-token pages, and a case's rows are
    # whole groups.
    assert all(prefix % 16 == 0 and rows % group == 0 for rows, group, prefix, _ in CASES)
