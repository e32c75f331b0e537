"""linear_cross_entropy: the fused MLM decoder + loss against `reference.linear_cross_entropy`.

The Triton loss/gradient kernel runs under the interpreter on CPU tensors (fp32, fp16); the
registered op's CPU implementation (chunked plain torch) is checked for losses and for the
gradients of x, W and b, in fp32 to fp32 rounding and in bf16 by the 2x rule.
"""

import pytest
import torch
import torch.nn.functional as F

import packedenc as pe
from packedenc.train import losses
from packedenc.kernels import get_ops, reference
from packedenc.kernels.triton import cross_entropy as CE
from tests.kernels._assert import DEVICE, assert_close_to_ref


def _case(M, D, V, dtype, device="cpu", ignore=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, D, generator=g)).to(device, dtype)
    w = (torch.randn(V, D, generator=g) * 0.5).to(device, dtype)  # logits of scale ~3: a peaked softmax
    b = (torch.randn(V, generator=g) * 0.1).to(device, dtype)
    t = torch.randint(0, V, (M,), generator=g)
    t[list(ignore)] = -100
    return x, w, b, t.to(device)


def _softmax_minus_onehot(logits, t):
    p = torch.softmax(logits.float(), -1)
    valid = t >= 0
    p[valid.nonzero()[:, 0], t[valid]] -= 1
    return p * valid[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("V,block", [(37, None), (100, 32)])  # one masked block; 4 blocks, the last partial
def test_kernel_loss_and_gradient_in_place(dtype, V, block):
    x, w, b, t = _case(9, 8, V, dtype, DEVICE, ignore=(3,))
    logits = F.linear(x, w, b)
    want_loss = F.cross_entropy(logits.float(), t, reduction="none")
    want_grad = _softmax_minus_onehot(logits, t)
    buf = logits.clone()
    loss = CE.ce_grad_(buf, t, block_v=block)
    assert loss.dtype == torch.float32 and loss[3] == 0 and torch.equal(buf[3], torch.zeros_like(buf[3]))
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-3  # one rounding of each gradient entry
    torch.testing.assert_close(buf.float(), want_grad, rtol=0, atol=tol)


def test_kernel_on_a_row_slice_of_a_wider_buffer():
    x, w, b, t = _case(5, 8, 40, torch.float32, DEVICE)
    big = torch.zeros(5, 48, device=DEVICE)
    big[:, :40] = F.linear(x, w, b)
    loss = CE.ce_grad_(big[:, :40], t, block_v=16)
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(x, w, b), t, reduction="none"), rtol=1e-5, atol=1e-5)
    assert torch.equal(big[:, 40:], torch.zeros(5, 8, device=DEVICE))  # nothing past V touched


def _grads(fn, inputs, t, cot):
    xs = [a.detach().clone().requires_grad_() for a in inputs]
    loss = fn(*xs, t)
    return (loss, *torch.autograd.grad(loss, xs, cot))


def test_cpu_chunks_give_the_same_losses_and_gradient_rows():
    x, w, b, t = _case(10, 12, 23, torch.float32, ignore=(0, 7))
    whole = CE.chunked_ce(x, w, b, t)
    for chunk in (3 * 23, 1, 23 * 10 - 1):  # chunks of 3 rows (M = 10), of 1 row, a ragged last chunk
        # Each chunk's logits are a GEMM whose reduction order BLAS picks by its shape (a 1-row
        # chunk may go to GEMV), so a logit of size ~3 can move by a few fp32 ulps (~1e-6) between
        # chunkings; a chunk holding the wrong rows would be off by O(0.1).
        for a, c in zip(CE.chunked_ce(x, w, b, t, chunk_elems=chunk), whole):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=2e-6)


def test_op_fp32_equals_reference_losses_and_grads():
    x, w, b, t = _case(10, 12, 23, torch.float32, ignore=(0, 7))
    cot = torch.randn(10)
    got = _grads(CE.linear_cross_entropy, (x, w, b), t, cot)
    want = _grads(reference.linear_cross_entropy, (x, w, b), t, cot)
    for name, a, c in zip(("loss", "dx", "dW", "db"), got, want):
        assert a.dtype == c.dtype, name
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(got[1][[0, 7]], torch.zeros(2, 12))  # ignored rows: no gradient
    no_bias = _grads(lambda x, w, t: CE.linear_cross_entropy(x, w, None, t), (x, w), t, cot)
    want_nb = _grads(lambda x, w, t: reference.linear_cross_entropy(x, w, None, t), (x, w), t, cot)
    for a, c in zip(no_bias, want_nb):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mean", [True, False])  # the mean's 1/M for every row; a per-row weight
def test_op_bf16_two_x_rule(mean):
    """bf16: logits rounded once (as F.linear), the saved gradient rounded once; the row scale
    goes on the small side of each GEMM (dx, dW) and through a split g (db). Inputs are
    bf16-representable, so the fp32 reference measures compute rounding only."""
    x, w, b, t = (a.bfloat16().float() if a.is_floating_point() else a
                  for a in _case(64, 32, 300, torch.float32, seed=1))
    cot = (torch.full((64,), 1 / 64) if mean else torch.rand(64, generator=torch.Generator().manual_seed(2)) / 64)
    cot = cot.bfloat16()
    got = _grads(CE.linear_cross_entropy, [a.bfloat16() for a in (x, w, b)], t, cot)
    lowp = _grads(reference.linear_cross_entropy, [a.bfloat16() for a in (x, w, b)], t, cot)
    f32 = _grads(reference.linear_cross_entropy, (x, w, b), t, cot.float())
    for name, a, c, e in zip(("loss", "dx", "dW", "db"), got, lowp, f32):
        assert_close_to_ref(a, e, c, atol=1e-6, what=name)  # errors are ~1e-4: the 2x term decides


def test_op_opcheck_compile_and_no_grad():
    x, w, b, t = _case(6, 8, 19, torch.float32, ignore=(2,))
    torch.library.opcheck(torch.ops.packedenc.linear_cross_entropy.default,
                          (x.requires_grad_(), w.requires_grad_(), b, t))
    f = lambda x, w, b: CE.linear_cross_entropy(x, w, b, t).sum()  # noqa: E731
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, b), f(x, w, b))
    with torch.no_grad():
        torch.testing.assert_close(CE.linear_cross_entropy(x, w, b, t), reference.linear_cross_entropy(x, w, b, t))
    with pytest.raises(TypeError, match="share one dtype"):
        CE.linear_cross_entropy(x, w.double(), b, t)


def test_saved_gradient_rows_are_aligned():
    """G (the saved softmax - onehot) has a 64-element row stride whatever the vocab, so the CUDA
    GEMMs that read and write it get 16-byte aligned rows; its values are the reference's."""
    x, w, b, t = _case(5, 8, 19, torch.float32)
    loss, grad = torch.ops.packedenc.linear_cross_entropy(x, w, b, t)
    assert grad.shape == (5, 19) and grad.stride() == (CE.ROW_ALIGN, 1)
    logits = F.linear(x, w, b)
    want = torch.softmax(logits, -1) - F.one_hot(t, 19)
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, F.cross_entropy(logits, t, reduction="none"))


def test_mlm_loss_fused_equals_logits_path():
    """losses.mlm_loss through the op (forced: on the CPU `auto` is the reference) equals
    F.cross_entropy on `mlm_logits` for a tiny ModernBERT, with the gradient of every leaf."""
    from packedenc.models import modernbert

    cfg = modernbert.ModernBertConfig(vocab_size=90, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=2, local_attention=4, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2, cls_token_id=1, sep_token_id=2)
    params = pe.init(cfg, torch.Generator().manual_seed(0), heads=("mlm",))
    b = pe.pack([list(range(3, 20)), list(range(30, 37)), [40]])
    pos, tgt = torch.tensor([0, 4, 9, 17, 20, 24]), torch.tensor([5, 6, 7, 8, -100, 9])
    ops = get_ops("reference")
    fused = type(ops)(**{**ops.__dict__, "linear_cross_entropy": CE.linear_cross_entropy})

    def loss(p, backend):
        h = pe.encode(p, b.ids, b.cu_seqlens, backend="reference")
        return losses.mlm_loss(p, h, pos, tgt, backend=backend)

    def plain(p):
        h = pe.encode(p, b.ids, b.cu_seqlens, backend="reference")
        logits = modernbert.mlm_logits(p, h[pos], backend="reference")
        return F.cross_entropy(logits.float(), tgt)  # ignore_index -100: mean over the 5 scored rows

    want, got = plain(params), loss(params, fused)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    leaves = lambda p: torch.utils._pytree.tree_leaves(p)  # noqa: E731
    p1 = torch.utils._pytree.tree_map(lambda t: t.detach().clone().requires_grad_(), params)
    p2 = torch.utils._pytree.tree_map(lambda t: t.detach().clone().requires_grad_(), params)
    loss(p1, fused).backward()
    plain(p2).backward()
    for a, c in zip(leaves(p1), leaves(p2)):
        torch.testing.assert_close(a.grad, c.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [50368, 128100])  # ModernBERT's; DeBERTa-v3's (rows padded to 128128)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_linear_cross_entropy(dtype, vocab):
    """Realistic shape (a real vocab, a few thousand masked rows): fp32 to 1e-4 relative,
    bf16 by the 2x rule; the kernel's G is the only (M, V) tensor kept for the backward."""
    x, w, b, t = _case(3000, 768, vocab, torch.float32, "cuda", ignore=(5,))
    x, w, b = (a.to(dtype).float() for a in (x, w * 0.1, b))  # representable: only compute rounding counts
    cot = torch.full((3000,), 1 / 2999, device="cuda").to(dtype)
    kern = get_ops("triton", "cuda").linear_cross_entropy
    got = _grads(kern, [a.to(dtype) for a in (x, w, b)], t, cot)
    f32 = _grads(reference.linear_cross_entropy, (x, w, b), t, cot.float())
    if dtype == torch.float32:
        for name, a, c in zip(("loss", "dx", "dW", "db"), got, f32):
            rel = ((a - c).norm() / c.norm()).item()
            assert rel <= 1e-4, f"{name}: relative error {rel:.2e}"
    else:
        lowp = _grads(reference.linear_cross_entropy, [a.to(dtype) for a in (x, w, b)], t, cot)
        for name, a, c, e in zip(("loss", "dx", "dW", "db"), got, lowp, f32):
            assert_close_to_ref(a, e, c, atol=1e-6, what=name)
