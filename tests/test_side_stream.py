"""kernels/side_stream.py off a GPU (or switched off): the held launches run on the current
stream, in turn, and an error in them reaches the caller. On a GPU (the last test, skipped
without one; run on the H200: benchmarks/h200/gpu_side_stream_error_a33b7ff.log) the current
stream waits for the side stream when the block is left, by an error too. The kernels run side by
side are checked by tests/test_paged_attention.py -k mixed and tests/test_gpu_cascade_side_by_side.py."""
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="two CUDA streams need a GPU")
@pytest.mark.parametrize("raise_inside", [False, True])
def test_on_a_gpu_the_current_stream_waits_for_the_side_stream_also_after_an_error(raise_inside):
    dev = torch.device("cuda")
    x = torch.zeros(1 << 20, device=dev)
    with side_stream(dev):      # a warm-up: the side stream is made outside the timed part
        pass
    torch.cuda.synchronize()
    try:
        with side_stream(dev) as on_side:
            with on_side:
                torch.cuda._sleep(200_000_000)       # ~0.1 s of GPU cycles, then the write
                x.fill_(1.0)
                if raise_inside:
                    raise ValueError("bad launch")
    except ValueError:
        assert raise_inside
    seen = x.clone()              # on the current stream: after the write only if it waited
    torch.cuda.synchronize()
    assert bool((seen == 1.0).all())
