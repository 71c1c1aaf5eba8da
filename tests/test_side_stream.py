"""kernels/side_stream.py off a GPU (or switched off): the held launches run on the current
stream, in turn, and an error in them reaches the caller. (On CUDA the two streams are checked by
the GPU tests: tests/test_paged_attention.py -k mixed, tests/test_gpu_cascade_side_by_side.py.)"""
import pytest
import torch

from kernels.side_stream import SIDE_STREAMS, side_stream


@pytest.mark.parametrize("enabled", [True, False])
def test_on_the_cpu_the_held_launches_run_first_in_turn(enabled):
    order = []
    with side_stream(torch.device("cpu"), enabled=enabled) as on_side:
        with on_side:
            order.append("held")
        order.append("beside")
    assert order == ["held", "beside"]
    assert torch.device("cpu") not in SIDE_STREAMS      # no stream is made off a GPU


def test_an_error_in_a_held_launch_reaches_the_caller():
    with pytest.raises(ValueError, match="bad launch"):
        with side_stream(torch.device("cpu")) as on_side:
            with on_side:
                raise ValueError("bad launch")
