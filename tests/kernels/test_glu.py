"""glu: act(u[:, :F]) * u[:, F:] for every activation of reference._ACTS, forward and backward."""

import pytest
import torch

from packedenc.errors import ConfigError
from packedenc.kernels import reference
from packedenc.kernels.reference import backward as reference_bwd
from packedenc.kernels.triton import glu as G
from tests.kernels._assert import CPU_LENGTHS, DEVICE, GPU_LENGTHS, assert_close_to_ref, other_rows

T_CPU = sum(CPU_LENGTHS)
ACTS = sorted(reference.ACTIVATIONS)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_glu_forward_and_backward_match_reference(act, dtype):
    F = 40  # not a multiple of the 32/64-wide column blocks
    u = (torch.randn(T_CPU, 2 * F) * 2).to(DEVICE, dtype)
    d = torch.randn(T_CPU, F).to(DEVICE, dtype)
    assert_close_to_ref(G.glu_fwd(u, act), reference.glu(u.float(), act), reference.glu(u, act), atol=1e-6, what=act)
    assert_close_to_ref(G.glu_bwd(d, u, act), reference_bwd.glu_bwd(d.float(), u.float(), act),
                        reference_bwd.glu_bwd(d, u, act), atol=2e-6, what=f"d{act}")


def test_glu_isolation_and_determinism():
    u = torch.randn(T_CPU, 2 * 24).to(DEVICE, torch.float16)
    y = G.glu_fwd(u)
    other = other_rows(CPU_LENGTHS, 2)
    u2 = u.clone()
    u2[other] *= -2
    y2 = G.glu_fwd(u2)
    assert torch.equal(y[~other], y2[~other]) and not torch.equal(y[other], y2[other])
    assert torch.equal(G.glu_fwd(u), y)


def test_glu_rejects_unknown_activation():
    with pytest.raises(ConfigError, match="not supported"):
        G.glu(torch.randn(2, 8), "mish")


def test_glu_op_opcheck_autograd_and_compile():
    u = torch.randn(5, 16)
    torch.library.opcheck(torch.ops.packedenc.glu.default, (u.clone().requires_grad_(), "gelu"))
    a, b = u.clone().requires_grad_(), u.clone().requires_grad_()
    w = torch.randn(5, 8)
    (G.glu(a, "silu") * w).sum().backward()
    (reference.glu(b, "silu") * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
    f = lambda x: G.glu(x, "gelu")  # noqa: E731
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(u), f(u))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "silu"])
def test_gpu_glu(dtype, act):
    from packedenc.kernels import get_ops

    ops = get_ops("triton", "cuda")
    T, F = sum(GPU_LENGTHS), 1152  # ModernBERT-base intermediate size
    u = (torch.randn(T, 2 * F, device="cuda") * 2).to(dtype)
    d = torch.randn(T, F, device="cuda").to(dtype)
    atol = 1e-5 if dtype == torch.float32 else 1e-3
    y = ops.glu(u, act)
    assert_close_to_ref(y, reference.glu(u.float(), act), reference.glu(u, act), atol=atol, what=act)
    assert torch.equal(ops.glu(u, act), y)
    leaf = u.detach().requires_grad_()
    ops.glu(leaf, act).backward(d)
    assert_close_to_ref(leaf.grad, reference_bwd.glu_bwd(d.float(), u.float(), act),
                        reference_bwd.glu_bwd(d, u, act), atol=atol, what=f"d{act}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_glu_overwrite_input_writes_the_first_half_in_eager_inference(dtype, monkeypatch):
    monkeypatch.setattr(G, "direct_launch", lambda *ts: True)  # the eager CUDA inference branch
    F = 40
    u = (torch.randn(T_CPU, 2 * F) * 2).to(DEVICE, dtype)
    want = G.glu_fwd(u, "gelu")
    kept = u.clone()
    assert torch.equal(G.glu(kept, "gelu"), want) and torch.equal(kept, u)  # default: input untouched
    gate = u[:, F:].clone()
    out = G.glu(u, "gelu", overwrite_input=True)
    assert out.shape == (T_CPU, F) and out.data_ptr() == u.data_ptr() and out.stride(0) == 2 * F
    assert torch.equal(out, want) and torch.equal(u[:, F:], gate)
    # the strided view feeds a GEMM like a contiguous one
    w = torch.randn(8, F).to(DEVICE, dtype)
    torch.testing.assert_close(torch.nn.functional.linear(out, w), torch.nn.functional.linear(want, w))
