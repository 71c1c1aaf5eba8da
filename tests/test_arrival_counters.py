"""kernels/arrival_counters.py: one zeroed buffer per (owner, device), grown on demand, never
freed while a graph may hold it, never allocated under CUDA graph capture."""
import pytest
import torch

from kernels import arrival_counters as ac


def test_one_zeroed_buffer_per_owner_grown_on_demand():
    dev = torch.device("cpu")
    a = ac.arrival_counters("test_owner_a", dev, 10)
    assert a.dtype == torch.int32 and a.numel() >= 10 and a.count_nonzero() == 0
    assert ac.arrival_counters("test_owner_a", dev, 5) is a             # shared by later calls
    assert ac.arrival_counters("test_owner_b", dev, 5) is not a         # owners apart
    big = ac.arrival_counters("test_owner_a", dev, a.numel() + 1)
    assert big.numel() > a.numel() and big.count_nonzero() == 0
    assert any(t is a for t in ac._REPLACED)    # a graph captured over `a` still finds it
    assert ac.arrival_counters("test_owner_a", dev, 1) is big


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_refuses_to_allocate_under_graph_capture():
    dev = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="before CUDA graph capture"):
            with torch.cuda.graph(graph, stream=stream):
                ac.arrival_counters("test_owner_capture", dev, 1)
