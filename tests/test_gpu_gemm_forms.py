"""scripts/gpu_gemm_forms.py's forms compute the same product as one matmul (the timing itself
needs a GPU: its results are in benchmarks/h200/gemm_forms.md)."""
import pytest
import torch

from scripts.gpu_gemm_forms import run_form


@pytest.mark.parametrize("form", ["full", "n2", "n3", "n4", "n7", "m128", "m512", "grouped", "k2", "k4",
                                  "k2h", "k4raw"])
def test_every_form_is_x_times_w_transposed(form):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 64, generator=gen)
    w = torch.randn(1000, 64, generator=gen)        # 1000 columns: the blocks' last one is short
    y = torch.full((300, 1000), float("nan"))
    got = run_form(form, x, w, y)
    if form.endswith("raw"):    # the float32 partials, one a slice of K
        assert got.shape == (4, 300, 1000)
        torch.testing.assert_close(got[1], x[:, 16:32] @ w[:, 16:32].t(), rtol=1e-5, atol=1e-5)
        got = got.sum(0)
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-5)
    if form not in ("grouped", "k4raw"):    # the others write every element of the given output
        assert got is y


def test_split_k_views_copy_nothing_and_refuse_an_uneven_split():
    from scripts.gpu_gemm_forms import split_k_views
    x, w = torch.randn(8, 12), torch.randn(5, 12)
    xs, ws = split_k_views(x, w, 3)
    assert xs.shape == (3, 8, 4) and ws.shape == (3, 4, 5)
    assert xs.data_ptr() == x.data_ptr() and ws.data_ptr() == w.data_ptr()
    with pytest.raises(ValueError, match="does not split in 5"):
        split_k_views(x, w, 5)


def test_an_unknown_form_names_itself():
    with pytest.raises(ValueError, match="z9"):
        run_form("z9", torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2))
