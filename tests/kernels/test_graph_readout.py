"""triton/graph_readout.py: the graph transformer's anchor_neighbor_attention readout vs the reference.

CPU: the kernels under TRITON_INTERPRET=1 (2-row steps: several per sequence) in fp32 / fp16, with
and without the bias, sequences of length 1 (anchor only), 2 and longer than a step: output and
every gradient; the registered op's autograd and torch.compile on the CPU reference; the op table
picks it on CUDA. GPU (`gpu`): bf16 at width 512 with the 2x rule.
"""

import pytest
import torch

from packedenc.kernels import reference
from packedenc.kernels.triton import graph_readout as R
from tests.kernels._assert import DEVICE, assert_close_to_ref, cu_seqlens

LENS = (1, 5, 3, 20, 2, 1, 7)


def _inputs(D, dtype, bias=True, lens=LENS, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(sum(lens), D, generator=g)
    w = torch.randn(1, 2 * D, generator=g) / D**0.5
    b = torch.randn(1, generator=g) if bias else None
    return [None if t is None else t.to(device, dtype) for t in (z, w, b)], cu_seqlens(lens, device)


def _ref_grads(z, w, b, cu, g, dtype=torch.float32):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (z, w) + ((b,) if b is not None else ())]
    out = reference.graph_readout(leaves[0], leaves[1], leaves[2] if b is not None else None, cu, 0)
    grads = torch.autograd.grad(out, leaves, g.to(dtype))
    return out, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_backward_equal_the_reference(dtype, bias):
    (z, w, b), cu = _inputs(24, dtype, bias)
    out, m, den = R.readout_fwd(z, w, b, cu, block_t=2)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(z.device, dtype)
    dz, dw, db = R.readout_bwd(g, z, w, b, cu, m, den, block_t=2)
    ref32, grads32 = _ref_grads(z, w, b, cu, g)
    assert out.dtype == dz.dtype == dtype and dw.shape == w.shape and (db is None) == (b is None)
    # anchor-only sequences (lengths 1) return their anchor exactly; their gradient is g
    for s in (0, 5):
        a = int(cu[s])
        torch.testing.assert_close(out[s], z[a])
        torch.testing.assert_close(dz[a], g[s])
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref32, atol=1e-5, rtol=1e-5)
        for got, want in zip((dz, dw, db), grads32):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        ref_lowp, grads_lowp = _ref_grads(z, w, b, cu, g, dtype)
        assert_close_to_ref(out, ref32, ref_lowp, what="out")
        for name, got, want, lowp in zip(("dz", "dw", "db"), (dz, dw, db), grads32, grads_lowp):
            assert_close_to_ref(got, want, lowp, atol=1e-3, what=name)


def test_registered_op_autograd_and_compile_on_cpu():
    (z, w, b), cu = _inputs(8, torch.float32, device="cpu")
    z, w, b = (t.requires_grad_() for t in (z, w, b))
    out = R.graph_readout(z, w, b, cu, max(LENS))
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (z, w, b), g)
    ref, ref_grads = _ref_grads(z, w, b, cu, g)
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    compiled = torch.compile(R.graph_readout, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(z, w, None, cu, max(LENS)), reference.graph_readout(z, w, None, cu, 0))


@pytest.mark.gpu
def test_gpu_op_table_picks_the_kernel_and_bf16_follows_the_2x_rule():
    import packedenc as pe

    assert dict(pe.get_ops("auto", "cuda").chosen)["graph_readout"] == "triton"
    lens = [1, 90, 3, 256, 17, 1, 64] * 20
    (z, w, b), cu = _inputs(512, torch.bfloat16, lens=lens, device="cuda")
    z, w, b = (t.requires_grad_() for t in (z, w, b))
    out = R.graph_readout(z, w, b, cu, max(lens))
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (z, w, b), g)
    ref32, grads32 = _ref_grads(z, w, b, cu, g)
    ref16, grads16 = _ref_grads(z, w, b, cu, g, torch.bfloat16)
    assert_close_to_ref(out, ref32, ref16, what="out")
    for name, got, want, lowp in zip(("dz", "dw", "db"), grads, grads32, grads16):
        assert_close_to_ref(got, want, lowp, atol=1e-3, what=name)
    with torch.no_grad():  # eager inference launches directly: same output
        assert torch.equal(R.graph_readout(z, w, b, cu, max(lens)), out.detach())
