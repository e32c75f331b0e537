"""flash.py: varlen attention backends (torch varlen_attn, aten flash custom op, flash-attn 2).

On the CPU only the registration of the aten custom op can run (its CPU implementation is the
reference), and the inputs flash refuses; the `gpu` tests check every installed implementation
against the reference. flash.py's graph_attention: tests/models/test_graph_transformer*.py.
FlashAttention-4 is the cute backend: tests/kernels/test_cute.py.
"""

import pytest
import torch

from packedenc.kernels import flash, reference
from tests.kernels._assert import GPU_LENGTHS, assert_close_to_ref, cu_seqlens, other_rows

CPU_LEN = (1, 6, 3)


def _qkv(T, H, K, dtype=torch.float32, device="cpu"):
    return [torch.randn(T, H, K, device=device).to(dtype) for _ in range(3)]


def test_inputs_flash_does_not_take_are_refused_and_left_to_the_table():
    # CPU tensors, fp32, head dims that are not multiples of 8: `covers_varlen` says no, the op
    # table routes those calls to the next choice, and a direct call says why it refuses
    from packedenc.errors import InputError

    cu = cu_seqlens(CPU_LEN, "cpu")
    for q in (torch.randn(10, 2, 8), torch.randn(10, 2, 8).half(), torch.randn(10, 2, 12).half()):
        assert not flash.covers_varlen(q, q, q, cu, 6)
        with pytest.raises(InputError, match="needs CUDA fp16 / bf16"):
            flash.varlen_attention(q, q, q, cu, 6, (2, 2))


def test_torch_at_least_2_11_offers_varlen_attn_with_a_window():
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert ("torch" in flash.IMPLS) == ((major, minor) >= (2, 11))
    # the choice is the documented order, not package presence: the first of ORDER on offer
    assert tuple(flash.IMPLS) == tuple(n for n in flash.ORDER if n in flash.IMPLS)
    assert flash.CHOSEN == next(iter(flash.IMPLS))
    if (major, minor) >= (2, 11):
        assert flash.CHOSEN == "torch"  # torch's own op, even where the flash-attn 2 package is installed
    assert "fa4" not in flash.IMPLS and not hasattr(flash, "fa4_varlen_attention")  # the cute backend's


def test_aten_op_opcheck_autograd_and_compile():
    q, k, v = _qkv(10, 2, 8)
    cu = cu_seqlens(CPU_LEN, "cpu")
    args = (q.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_(), cu, 6, 2, 2, None)
    torch.library.opcheck(torch.ops.packedenc.flash_varlen_fwd.default, args)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    w = torch.randn(10, 2, 8)
    (flash.aten_varlen_attention(*leaves, cu, 6, (2, 2)) * w).sum().backward()
    (reference.varlen_attention(*refs, cu, 6, (2, 2)) * w).sum().backward()
    for a, b in zip(leaves, refs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    f = lambda q, k, v: flash.aten_varlen_attention(q, k, v, cu, 6, (2, 2))  # noqa: E731
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v), f(q, k, v))


GPU_T = sum(GPU_LENGTHS)


def _eager_lowp(q, k, v, cu, L, window):
    """The plain low-precision attention (HF eager): bf16 scores, fp32 softmax rounded, bf16 P @ V.

    It is the 2x rule's baseline here because reference.varlen_attention upcasts to fp32 inside
    and is therefore far more accurate than any bf16 attention, flash or eager.
    """
    from packedenc.packing import segment_ids

    T, H, K = q.shape
    seq, i = segment_ids(cu, T), torch.arange(T, device=q.device)
    keep = seq[:, None] == seq[None, :]
    if window[0] >= 0:
        keep &= i[None, :] >= i[:, None] - window[0]
    if window[1] >= 0:
        keep &= i[None, :] <= i[:, None] + window[1]
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))
    s = (qh @ kh.transpose(1, 2)) * K**-0.5
    p = torch.softmax(s.float().masked_fill(~keep, float("-inf")), dim=-1).to(q.dtype)
    return (p @ vh).transpose(0, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", sorted(flash.IMPLS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [(-1, -1), (64, 64)])  # ModernBERT global / local layers
def test_gpu_forward(impl, dtype, window):
    fn = flash.IMPLS[impl]
    q, k, v = _qkv(GPU_T, 12, 64, dtype, "cuda")
    cu, L = cu_seqlens(GPU_LENGTHS, "cuda"), max(GPU_LENGTHS)
    out = fn(q, k, v, cu, L, window)
    ref32 = reference.varlen_attention(q.float(), k.float(), v.float(), cu, L, window)
    assert_close_to_ref(out, ref32, _eager_lowp(q, k, v, cu, L, window), atol=1e-3, what=impl)
    assert torch.equal(fn(q, k, v, cu, L, window), out)  # deterministic forward
    other = other_rows(GPU_LENGTHS, 7)  # the 2047-token sequence
    k2, v2 = k.clone(), v.clone()
    k2[other] *= 5
    v2[other] += 1
    out2 = fn(q, k2, v2, cu, L, window)
    assert torch.equal(out[~other], out2[~other]) and not torch.equal(out[other], out2[other])


@pytest.mark.gpu
@pytest.mark.parametrize("impl", sorted(flash.IMPLS))
@pytest.mark.parametrize("window", [(-1, -1), (64, 64)])
def test_gpu_backward(impl, window):
    fn = flash.IMPLS[impl]
    lengths = (1, 63, 64, 65, 129, 700)  # the reference backward is dense: keep it moderate
    T = sum(lengths)
    cu, L = cu_seqlens(lengths, "cuda"), max(lengths)
    q, k, v = _qkv(T, 12, 64, torch.bfloat16, "cuda")
    do = torch.randn(T, 12, 64, device="cuda").to(torch.bfloat16)

    def grads(f, cast):
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(f(*leaves, cu, L, window), leaves, do.to(cast))

    got, lowp, f32 = grads(fn, torch.bfloat16), grads(_eager_lowp, torch.bfloat16), grads(reference.varlen_attention, torch.float32)
    for name, a, b, c in zip(("dq", "dk", "dv"), got, lowp, f32):
        assert_close_to_ref(a, c, b, atol=1e-3, what=f"{impl} {name}")
