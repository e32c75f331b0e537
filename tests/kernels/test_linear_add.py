"""`linear_add`: a block's output projection with the residual added in the GEMM (cuBLAS's beta = 1)."""

import pytest
import torch

from packedenc.errors import InputError
from packedenc.kernels import get_ops


@pytest.mark.parametrize("bias", [False, True])
def test_linear_add_is_the_residual_plus_the_projection(bias):
    g = torch.Generator().manual_seed(0)
    x, w, r = torch.randn(7, 5, generator=g), torch.randn(3, 5, generator=g), torch.randn(7, 3, generator=g)
    b = torch.randn(3, generator=g) if bias else None
    got = get_ops("auto", "cpu").linear_add(x, w, b, r)
    want = r + x @ w.t() + (0 if b is None else b)
    torch.testing.assert_close(got, want)
    assert got.data_ptr() != r.data_ptr()  # a new tensor: the residual is not overwritten


def test_linear_add_rejects_mismatched_shapes():
    ops = get_ops("reference", "cpu")
    x, w = torch.randn(7, 5), torch.randn(3, 5)
    with pytest.raises(InputError, match="does not match the residual"):
        ops.linear_add(x, w, None, torch.randn(7, 4))
    with pytest.raises(InputError, match="does not match the residual"):
        ops.linear_add(x.view(7, 5, 1).expand(7, 5, 2), w, None, torch.randn(7, 3))
    with pytest.raises(InputError, match="must share a dtype"):
        ops.linear_add(x, w, None, torch.randn(7, 3, dtype=torch.float64))


@pytest.mark.parametrize("bias", [False, True])
def test_linear_add_overwrites_the_residual_only_when_given_it(bias):
    g = torch.Generator().manual_seed(1)
    x, w, r = torch.randn(6, 4, generator=g), torch.randn(5, 4, generator=g), torch.randn(6, 5, generator=g)
    b = torch.randn(5, generator=g) if bias else None
    want = r + x @ w.t() + (0 if b is None else b)
    ops = get_ops("reference", "cpu")
    r_in = r.clone()
    got = ops.linear_add(x, w, b, r_in, overwrite_input=True)
    assert got.data_ptr() == r_in.data_ptr()  # addmm_ into the residual: no copy of it first
    torch.testing.assert_close(got, want)
    leaf = r.clone().requires_grad_()  # autograd needs the residual: never written in place
    out = ops.linear_add(x, w, b, leaf, overwrite_input=True)
    assert out.data_ptr() != leaf.data_ptr()
    torch.testing.assert_close(out, want)
    (dr,) = torch.autograd.grad(out.sum(), leaf)
    torch.testing.assert_close(dr, torch.ones_like(r))
