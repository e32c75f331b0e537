"""rotary: RoPE on q and k straight from the (T, 3, H, K) Wqkv output, vs the reference.

Per-token positions restart in every packed sequence; cos/sin are taken in fp32 and rounded to
the activation dtype (transformers 5.x), the rotation is fp32 with one rounding.
"""

import pytest
import torch

from packedenc.kernels import reference
from packedenc.kernels.reference import backward as reference_bwd
from packedenc.kernels.triton import rotary as RO
from tests.kernels._assert import (
    CPU_LENGTHS, DEVICE, GPU_LENGTHS, assert_close_to_ref, other_rows, positions,
)

T_CPU = sum(CPU_LENGTHS)


def _qkv(T, H, K, dtype, device=DEVICE):
    return torch.randn(T, 3, H, K).to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("H,K", [(3, 16), (2, 24)])  # 24: 12 frequencies in a 16-wide block
@pytest.mark.parametrize("theta", [10000.0, 160000.0])  # ModernBERT local / global
def test_rotary_matches_reference(dtype, H, K, theta):
    qkv, pos = _qkv(T_CPU, H, K, dtype), positions(CPU_LENGTHS)
    q, k = RO.rotary_fwd(qkv, pos, theta)
    assert q.is_contiguous() and k.is_contiguous()
    q32, k32 = reference.rotary(qkv.float(), pos, theta)
    ql, kl = reference.rotary(qkv, pos, theta)
    assert_close_to_ref(q, q32, ql, atol=1e-6, what="q")
    assert_close_to_ref(k, k32, kl, atol=1e-6, what="k")


def test_rotary_reads_a_strided_qkv_and_honours_scaling():
    # qkv as a view of a wider buffer (row stride > 3*H*K) and attention_scaling != 1
    big = torch.randn(T_CPU, 3 * 2 * 16 + 8).to(DEVICE)
    qkv = big[:, : 3 * 2 * 16].view(T_CPU, 3, 2, 16)
    pos = positions(CPU_LENGTHS) * 37  # larger angles
    q, k = RO.rotary_fwd(qkv, pos, 10000.0, 1.25)
    qr, kr = reference.rotary(qkv, pos, 10000.0, 1.25)
    torch.testing.assert_close(q, qr, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(k, kr, rtol=1e-6, atol=2e-6)


def test_rotary_isolation_and_determinism():
    qkv, pos = _qkv(T_CPU, 2, 16, torch.float16), positions(CPU_LENGTHS)
    q, k = RO.rotary_fwd(qkv, pos, 10000.0)
    other = other_rows(CPU_LENGTHS, 1)
    qkv2 = qkv.clone()
    qkv2[other] *= 3
    q2, k2 = RO.rotary_fwd(qkv2, pos, 10000.0)
    assert torch.equal(q[~other], q2[~other]) and torch.equal(k[~other], k2[~other])
    assert not torch.equal(q[other], q2[other])
    q3, k3 = RO.rotary_fwd(qkv, pos, 10000.0)
    assert torch.equal(q, q3) and torch.equal(k, k3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_backward_kernel(dtype):
    pos = positions(CPU_LENGTHS)
    dq, dk = torch.randn(T_CPU, 2, 16).to(DEVICE, dtype), torch.randn(T_CPU, 2, 16).to(DEVICE, dtype)
    got = RO.rotary_bwd(dq, dk, pos, 10000.0)
    assert torch.equal(got[:, 2], torch.zeros_like(got[:, 2]))
    ref32 = reference_bwd.rotary_bwd(dq.float(), dk.float(), pos, 10000.0)
    assert_close_to_ref(got, ref32, reference_bwd.rotary_bwd(dq, dk, pos, 10000.0), atol=1e-6, what="dqkv")


def test_rotary_op_opcheck_autograd_and_compile():
    qkv, pos = torch.randn(6, 3, 2, 8), torch.tensor([0, 1, 2, 0, 1, 0])
    torch.library.opcheck(torch.ops.packedenc.rotary.default, (qkv.requires_grad_(), pos, 10000.0, 1.0))
    leaf = qkv.detach().clone().requires_grad_()
    leaf_ref = qkv.detach().clone().requires_grad_()
    w = torch.randn(6, 2, 8)
    (RO.rotary(leaf, pos, 10000.0)[0] * w).sum().backward()
    (reference.rotary(leaf_ref, pos, 10000.0)[0] * w).sum().backward()
    torch.testing.assert_close(leaf.grad, leaf_ref.grad)
    f = lambda x: RO.rotary(x, pos, 10000.0)  # noqa: E731
    for a, b in zip(torch.compile(f, fullgraph=True, backend="aot_eager")(qkv.detach()), f(qkv.detach())):
        torch.testing.assert_close(a, b)


GPU_T = sum(GPU_LENGTHS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("theta", [10000.0, 160000.0])
def test_gpu_rotary(dtype, theta):
    """References run on the CPU: their inv_freq is HF's (computed on the CPU at init), which the
    kernel uses too; torch's CUDA pow may differ by an ulp, which at position 8k moves the
    angle by ~5e-4 rad."""
    from packedenc.kernels import get_ops

    ops = get_ops("triton", "cuda")
    qkv, pos = _qkv(GPU_T, 12, 64, dtype, "cuda"), positions(GPU_LENGTHS, "cuda")
    cpu = lambda fn, *a: [t.cuda() for t in fn(*(x.cpu() if torch.is_tensor(x) else x for x in a))]  # noqa: E731
    atol = 1e-5 if dtype == torch.float32 else 1e-3
    for offset in (0, 8000):  # 8000+: the in-kernel cos/sin must stay accurate at thousands of rad
        p = pos + offset
        q, k = ops.rotary(qkv, p, theta)
        q32, k32 = cpu(reference.rotary, qkv.float(), p, theta)
        ql, kl = cpu(reference.rotary, qkv, p, theta)
        assert_close_to_ref(q, q32, ql, atol=atol, what=f"q, positions +{offset}")
        assert_close_to_ref(k, k32, kl, atol=atol, what=f"k, positions +{offset}")
    q, k = ops.rotary(qkv, pos, theta)
    assert torch.equal(ops.rotary(qkv, pos, theta)[0], q)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    leaf = qkv.detach().requires_grad_()
    torch.autograd.backward(ops.rotary(leaf, pos, theta), (dq, dk))
    (d32,) = cpu(lambda *a: (reference_bwd.rotary_bwd(*a),), dq.float(), dk.float(), pos, theta)
    (dl,) = cpu(lambda *a: (reference_bwd.rotary_bwd(*a),), dq, dk, pos, theta)
    assert_close_to_ref(leaf.grad, d32, dl, atol=atol, what="dqkv")


# ---- with_v: (q, k, v) for training ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_with_v_copies_v_and_writes_every_gradient_slot(dtype):
    qkv, pos = _qkv(T_CPU, 2, 16, dtype), positions(CPU_LENGTHS)
    q, k, v = RO.rotary_fwd(qkv, pos, 10000.0, with_v=True)
    q0, k0 = RO.rotary_fwd(qkv, pos, 10000.0)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert v.is_contiguous() and torch.equal(v, qkv[:, 2])
    dq, dk, dv = (torch.randn(T_CPU, 2, 16).to(DEVICE, dtype) for _ in range(3))
    got = RO.rotary_bwd(dq, dk, pos, 10000.0, dv_THK=dv)
    assert torch.equal(got[:, 2], dv)  # every slot written (the buffer is uninitialised)
    assert torch.equal(got[:, :2], RO.rotary_bwd(dq, dk, pos, 10000.0)[:, :2])
    ref32 = reference_bwd.rotary_bwd(dq.float(), dk.float(), pos, 10000.0, dv_THK=dv.float())
    assert_close_to_ref(got, ref32, reference_bwd.rotary_bwd(dq, dk, pos, 10000.0, dv_THK=dv), atol=1e-6,
                        what="dqkv")


def test_rotary_qkv_op_opcheck_autograd_and_compile():
    qkv, pos = torch.randn(6, 3, 2, 8), torch.tensor([0, 1, 2, 0, 1, 0])
    torch.library.opcheck(torch.ops.packedenc.rotary_qkv.default, (qkv.requires_grad_(), pos, 10000.0, 1.0))
    leaf, leaf_ref = (qkv.detach().clone().requires_grad_() for _ in range(2))
    cot = [torch.randn(6, 2, 8) for _ in range(3)]
    out = RO.rotary(leaf, pos, 10000.0, with_v=True)
    assert len(out) == 3 and out[2].data_ptr() != leaf.data_ptr()  # its own v (a gradient is needed)
    torch.autograd.backward(out, cot)
    torch.autograd.backward(reference.rotary(leaf_ref, pos, 10000.0, with_v=True), cot)
    torch.testing.assert_close(leaf.grad, leaf_ref.grad)
    assert torch.equal(leaf.grad[:, 2], cot[2])
    f = lambda x: RO.rotary(x, pos, 10000.0, with_v=True)  # noqa: E731
    x = qkv.detach().clone().requires_grad_()
    for a, b in zip(torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x)):
        torch.testing.assert_close(a, b)
    # no gradient needed: v is the view, nothing copied
    with torch.no_grad():
        q, k, v = RO.rotary(qkv, pos, 10000.0, with_v=True)
    assert v.data_ptr() == qkv[:, 2].data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_overwrite_input_rotates_in_place_in_eager_inference(dtype, monkeypatch):
    # the in-place path is taken on eager CUDA inference; force that branch here (interpreter)
    monkeypatch.setattr(RO, "direct_launch", lambda *ts: True)
    qkv, pos = _qkv(T_CPU, 3, 16, dtype), positions(CPU_LENGTHS)
    want_q, want_k = RO.rotary_fwd(qkv, pos, 10000.0)
    v0 = qkv[:, 2].clone()
    kept = qkv.clone()
    q, k, v = RO.rotary(kept, pos, 10000.0, with_v=True)  # default: the input is left alone
    assert torch.equal(kept, qkv) and torch.equal(q, want_q) and torch.equal(k, want_k)
    q, k, v = RO.rotary(qkv, pos, 10000.0, with_v=True, overwrite_input=True)
    assert q.data_ptr() == qkv.data_ptr() and v.data_ptr() == qkv[:, 2].data_ptr()  # views, no new buffers
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, v0)
    assert torch.equal(qkv[:, 0], want_q)  # the input now holds the rotated q
