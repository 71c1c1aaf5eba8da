"""scripts/gpu_gemm_forms.py's forms compute the same product as one matmul (the timing itself
needs a GPU: its results are in benchmarks/h200/gemm_forms.md)."""
import pytest
import torch

from scripts.gpu_gemm_forms import run_form


@pytest.mark.parametrize("form", ["full", "n2", "n3", "n4", "n7", "m128", "m512", "grouped"])
def test_every_form_is_x_times_w_transposed(form):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 64, generator=gen)
    w = torch.randn(1000, 64, generator=gen)        # 1000 columns: the blocks' last one is short
    y = torch.full((300, 1000), float("nan"))
    got = run_form(form, x, w, y)
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-5)
    if form != "grouped":       # the others write every element of the given output
        assert got is y


def test_an_unknown_form_names_itself():
    with pytest.raises(ValueError, match="k9"):
        run_form("k9", torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2))
