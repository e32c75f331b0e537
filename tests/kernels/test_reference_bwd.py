"""reference_bwd: the hand-written backward of every fused op equals autograd through reference.py.

These functions are the CPU implementation of the `packedenc::*_bwd` ops and the oracle of the GPU
backward kernels, so they are checked against autograd in fp32 first.
"""

import pytest
import torch

from packedenc.kernels import reference
from packedenc.kernels.reference import backward as reference_bwd


def _vjp(fn, inputs, cot):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return torch.autograd.grad(out, leaves, cot)


def test_layer_norm_bwd_equals_autograd_incl_add_layer_norm():
    x, r, w = torch.randn(7, 12), torch.randn(7, 12), torch.randn(12)
    dy, ds = torch.randn(7, 12), torch.randn(7, 12)
    dx, dw, db = reference_bwd.layer_norm_bwd(dy, x, w, 1e-5)
    ax, aw, ab = _vjp(lambda x, w, b: reference.layer_norm(x, w, b, 1e-5), (x, w, torch.zeros(12)), dy)
    for a, b in ((dx, ax), (dw, aw), (db, ab)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # add_layer_norm: the sum's own gradient is added to the LayerNorm input gradient
    dsum_total, _, _ = reference_bwd.layer_norm_bwd(dy, x + r, w, 1e-5, ds)
    gx, gr = _vjp(lambda x, r: reference.add_layer_norm(x, r, w, None, 1e-5), (x, r), (dy, ds))
    torch.testing.assert_close(dsum_total, gx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dsum_total, gr, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("act", sorted(reference.ACTIVATIONS))
def test_glu_bwd_equals_autograd(act):
    u, d = torch.randn(6, 10) * 2, torch.randn(6, 5)
    (au,) = _vjp(lambda u: reference.glu(u, act), (u,), d)
    torch.testing.assert_close(reference_bwd.glu_bwd(d, u, act), au, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scaling", [1.0, 0.75])
def test_rotary_bwd_equals_autograd(scaling):
    qkv, pos = torch.randn(6, 3, 2, 8), torch.tensor([0, 1, 2, 0, 1, 300])
    dq, dk = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    (a,) = _vjp(lambda x: reference.rotary(x, pos, 10000.0, scaling), (qkv,), (dq, dk))
    torch.testing.assert_close(reference_bwd.rotary_bwd(dq, dk, pos, 10000.0, scaling), a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [(-1, -1), (2, 2), (1, 3)])
def test_varlen_attention_bwd_equals_autograd(window):
    lengths = [1, 6, 3]
    cu = torch.tensor([0, 1, 7, 10], dtype=torch.int32)
    q, k, v, do = (torch.randn(10, 2, 4) for _ in range(4))
    got = reference_bwd.varlen_attention_bwd(do, q, k, v, cu, window)
    want = _vjp(lambda q, k, v: reference.varlen_attention(q, k, v, cu, max(lengths), window), (q, k, v), do)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_rotary_bwd_with_v_equals_autograd():
    qkv, pos = torch.randn(6, 3, 2, 8), torch.tensor([0, 1, 2, 0, 1, 300])
    dq, dk, dv = torch.randn(6, 2, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    (a,) = _vjp(lambda x: reference.rotary(x, pos, 10000.0, with_v=True), (qkv,), (dq, dk, dv))
    torch.testing.assert_close(reference_bwd.rotary_bwd(dq, dk, pos, 10000.0, dv_THK=dv), a, rtol=1e-5, atol=1e-6)
