"""engine/models/linear.py: the projections run F.linear unless their table names a skinny GEMM
config for the input's row bucket.

The Triton kernels run under the interpreter on CPU (fp32 here)."""
import pytest
import torch
import torch.nn.functional as F

from tests.kernel_support import DEVICE, load_kernels, require_runnable

sg = load_kernels("kernels.skinny_gemm")
activation = load_kernels("kernels.activation")

import engine.models.linear as linear_module  # noqa: E402  (after the kernels are interpreted)
from engine.models.linear import ROW_BUCKETS, Linear, row_bucket  # noqa: E402


@pytest.fixture(autouse=True)
def kernels_can_run_here():
    require_runnable(sg)
    require_runnable(activation)


def test_row_buckets():
    assert ROW_BUCKETS == (1, 2, 4, 8, 16)
    assert [row_bucket(m) for m in (0, 1, 2, 3, 5, 8, 9, 16, 17, 256)] == [1, 1, 2, 4, 8, 8, 16, 16, 0, 0]


def make_linear(n, k, bias, seed=0):
    torch.manual_seed(seed)
    lin = Linear(k, n, bias=bias).to(DEVICE)
    lin.requires_grad_(False)
    return lin


@pytest.fixture
def counted(monkeypatch):
    """Calls to the skinny GEMM from engine/models/linear.py: (rows, silu_mul, config), and
    (rows, silu_mul, config, pdl) for calls with pdl=True, which the interpreter cannot launch:
    those run without it (what they compute is the same); + "unmerged" for merge=False."""
    calls = []

    def run(x, weight, bias=None, *, silu_mul=False, config=None, pdl=False, merge=True, out=None):
        calls.append((x.shape[0], silu_mul, config) + ((True,) if pdl else ()) + (() if merge else ("unmerged",))
                     + (() if out is None else ("out",)))
        return sg.skinny_gemm(x, weight, bias, silu_mul=silu_mul, config=config, merge=merge, out=out)
    monkeypatch.setattr(linear_module, "skinny_gemm", run)
    monkeypatch.setattr(linear_module, "silu_and_mul", activation.silu_and_mul)
    return calls


def test_empty_table_is_f_linear(counted):
    lin = make_linear(37, 48, bias=True)
    for m in (1, 3, 16, 40):
        x = torch.randn(m, 48, device=DEVICE)
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
        g = torch.randn(m, 96, device=DEVICE)
        assert torch.equal(lin.forward_silu_mul(g), F.linear(activation.silu_and_mul(g), lin.weight, lin.bias))
    assert counted == []


def test_rows_in_a_chosen_bucket_run_the_skinny_gemm(counted):
    lin = make_linear(37, 48, bias=True, seed=1)
    one, four = sg.SkinnyConfig(16, 16, 2), sg.SkinnyConfig(32, 32, 1)
    lin.skinny = {1: one, 4: four}
    for m in (1, 2, 3, 4, 5, 17):
        x = torch.randn(m, 48, device=DEVICE)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-4, rtol=1.3e-6)
    assert counted == [(1, False, one), (3, False, four), (4, False, four)]
    strided = torch.randn(48, 4, device=DEVICE).T       # column stride 4: F.linear
    torch.testing.assert_close(lin(strided), F.linear(strided, lin.weight, lin.bias))
    assert len(counted) == 3


def test_silu_table_folds_silu_and_mul_into_the_kernel(counted):
    lin = make_linear(21, 40, bias=False, seed=2)
    cfg = sg.SkinnyConfig(16, 16, 3)
    lin.skinny_silu = {2: cfg}
    g = 3 * torch.randn(2, 80, device=DEVICE)
    got = lin.forward_silu_mul(g)
    assert counted == [(2, True, cfg)]
    assert torch.equal(got, sg.skinny_gemm(activation.silu_and_mul(g), lin.weight, config=cfg))
    lin.forward_silu_mul(g[:1])                          # bucket 1 not chosen: kernel + F.linear
    assert len(counted) == 1


def test_a_pdl_call_runs_the_chain_table_and_passes_pdl_on(counted, monkeypatch):
    """In a PDL chain (kernels/pdl.py) every projection with a skinny_chain config runs the skinny
    GEMM launched with PDL, also where cuBLAS won the start-up timing (no `skinny` entry); the
    SiLU-and-mul kernel before down_proj is launched with PDL too."""
    lin = make_linear(37, 48, bias=True, seed=3)
    plain, chain = sg.SkinnyConfig(16, 16, 2), sg.SkinnyConfig(32, 16, 1)
    lin.skinny, lin.skinny_chain = {1: plain}, {1: chain, 2: chain}
    x = torch.randn(2, 48, device=DEVICE)
    torch.testing.assert_close(lin(x, pdl=True), F.linear(x, lin.weight, lin.bias), atol=1e-4, rtol=1.3e-6)
    lin(x[:1], pdl=True)
    lin(x[:1])
    lin(x, pdl=False)                                   # bucket 2: cuBLAS won, F.linear
    torch.testing.assert_close(lin(torch.randn(17, 48, device=DEVICE), pdl=True).shape, torch.Size([17, 37]))
    assert counted == [(2, False, chain, True), (1, False, chain, True), (1, False, plain)]
    silu_calls = []

    def silu(g, *, out=None, pdl=False):
        silu_calls.append(pdl)
        return activation.silu_and_mul(g, out=out)
    monkeypatch.setattr(linear_module, "silu_and_mul", silu)
    down = make_linear(37, 24, bias=False, seed=4)
    down.skinny_chain = {2: chain}
    g = torch.randn(2, 48, device=DEVICE)
    got = down.forward_silu_mul(g, pdl=True)
    assert silu_calls == [True] and counted[-1] == (2, False, chain, True)
    torch.testing.assert_close(got, F.linear(activation.silu_and_mul(g), down.weight), atol=1e-4, rtol=1.3e-6)


def test_unmerged_output_is_split_sums_where_the_skinny_gemm_runs(counted):
    """unmerged=True: with a skinny config the K slices' partials and the bias come back as
    SplitSums, whose merge is the merged call's output bit for bit; without one, F.linear."""
    from engine.models.linear import SplitSums
    lin = make_linear(37, 48, bias=True, seed=7)
    cfg = sg.SkinnyConfig(16, 16, 3)
    lin.skinny = {2: cfg}
    x = torch.randn(2, 48, device=DEVICE)
    got = lin(x, unmerged=True)
    assert isinstance(got, SplitSums) and got.parts.shape == (3, 2, 37) and got.bias is lin.bias
    assert torch.equal(got.merged(x.dtype), lin(x))
    assert counted == [(2, False, cfg, "unmerged"), (2, False, cfg)]
    g = torch.randn(2, 96, device=DEVICE)
    sums = lin.forward_silu_mul(g, unmerged=True)       # no silu table: the SiLU kernel, then this
    assert isinstance(sums, SplitSums) and torch.equal(sums.merged(g.dtype), lin.forward_silu_mul(g))
    x3 = torch.randn(3, 48, device=DEVICE)              # no config for 3 rows (bucket 4)
    assert torch.equal(lin(x3, unmerged=True), F.linear(x3, lin.weight, lin.bias))


@pytest.mark.parametrize("bias", [False, True])
def test_out_is_written_in_place_by_either_kernel(counted, bias):
    """out= (the lm_head into a decode graph's logits buffer): the output lands in the buffer,
    which is returned, with the values of the call without it: by the skinny GEMM where a config
    is chosen, by cuBLAS / the CPU's matmul elsewhere."""
    lin = make_linear(37, 48, bias=bias, seed=8)
    cfg = sg.SkinnyConfig(16, 16, 2)
    lin.skinny = {2: cfg}
    for m in (2, 3):                                    # bucket 2 chosen; 3 rows: F.linear's kernel
        x = torch.randn(m, 48, device=DEVICE)
        buf = torch.full((m, 37), float("nan"), device=DEVICE)
        got = lin(x, out=buf)
        assert got.data_ptr() == buf.data_ptr() and torch.equal(buf, lin(x))
    assert counted == [(2, False, cfg, "out"), (2, False, cfg)]
