"""`layer_norm_linear`: the LayerNorm before a projection read inside the GEMM (`kernels/triton/
layer_norm_linear.py`: `linear_glu.py`'s kernel with the gate off and its NORM prologue), and the
op's parts (the table's `layer_norm`, then its `linear`), which run every call the fused kernel does
not take."""

import dataclasses

import pytest
import torch

import packedenc as pe
from packedenc.errors import InputError
from packedenc.kernels import choose, get_ops, reference
from packedenc.kernels.triton import layer_norm_linear as LL
from packedenc.kernels.triton import linear_glu as LG
from tests.kernels._assert import assert_close_to_ref


def _operands(T, D, N, dtype, bias, device="cpu", seed=0, offset=0.5):
    """x with a mean off zero (the kernel subtracts it after the dot), a norm weight around 1,
    W (N, D), a bias or None."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(T, D, device=device, generator=g) * 2 + offset).to(dtype)
    nw = (torch.rand(D, device=device, generator=g) + 0.5).to(dtype)
    w = (torch.randn(N, D, device=device, generator=g) / D**0.5).to(dtype)
    b = (torch.randn(N, device=device, generator=g) / 4).to(dtype) if bias else None
    return x, nw, w, b


def _want(x, nw, w, b, eps=1e-5):
    """fp32 reference, and the parts in x's dtype (the normalised rows rounded, then the GEMM)."""
    f = [None if t is None else t.float() for t in (x, nw, w, b)]
    return (reference.layer_norm_linear(f[0], f[1], None, eps, f[2], f[3]),
            reference.layer_norm_linear(x, nw, None, eps, w, b))


def test_the_reference_is_the_two_ops_it_replaces_and_the_parts_end_every_chain():
    x, nw, w, b = _operands(5, 16, 12, torch.float32, True)
    nb = torch.randn(16)
    for norm_bias in (None, nb):  # the reference takes a norm bias too (the fused kernel does not)
        want = reference.linear(reference.layer_norm(x, nw, norm_bias, 1e-6), w, b)
        assert torch.equal(reference.layer_norm_linear(x, nw, norm_bias, 1e-6, w, b), want)
    every = {"triton", "flash"}.__contains__
    assert choose("layer_norm_linear", "reference", "cuda", every) == "layer_norm+linear"
    assert choose("layer_norm_linear", "triton", "cuda", every) == "triton>layer_norm+linear"
    assert choose("layer_norm_linear", "auto", "cuda", every) == "layer_norm+linear"  # row not chosen yet
    assert choose("layer_norm_linear", "auto", "cpu") == "layer_norm+linear"
    ops = get_ops("auto", "cpu")  # the parts are the table's own entries
    assert torch.equal(ops.layer_norm_linear(x, nw, None, 1e-6, w, b), reference.layer_norm_linear(x, nw, None, 1e-6, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(9, 32, 24, None), (37, 40, 72, (16, 32, 16, 4, 1)), (20, 48, 40, (16, 16, 32, 4, 2))])
def test_fused_norm_gemm_matches_the_reference(dtype, bias, shape):
    # one tile with masked rows and columns (the default tile); several with masked rows, columns
    # and a K tail; an odd tile count of columns
    T, D, N, tile = shape
    x, nw, w, b = _operands(T, D, N, dtype, bias)
    for eps in (1e-5, 1e-2):
        y = LG.linear_glu_fwd(x, w, b, None, tile=tile, norm_weight=nw, eps=eps)
        assert y.shape == (T, N) and y.is_contiguous()
        want, parts = _want(x, nw, w, b, eps)
        if dtype == torch.float32:
            torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
        else:  # x * w rounded where the parts round the normalised rows
            assert_close_to_ref(y, want, parts, atol=1e-3, what="layer_norm_linear")


def test_the_ungated_gemm_without_the_norm_is_a_plain_projection():
    x, _, w, b = _operands(19, 40, 24, torch.float32, True, offset=0.0)
    y = LG.linear_glu_fwd(x, w, b, None, tile=(16, 16, 16, 4, 1))
    torch.testing.assert_close(y, reference.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_rows_stay_in_their_row_and_the_table_entry_is_the_same_kernel():
    x, nw, w, b = _operands(21, 32, 40, torch.float32, True)
    y = LL.layer_norm_linear(x, nw, None, 1e-5, w, b)
    x2 = x.clone()
    x2[7] = x2[7] * 3 + 1  # another row's statistics
    y2 = LL.layer_norm_linear(x2, nw, None, 1e-5, w, b)
    assert torch.equal(y2[:7], y[:7]) and torch.equal(y2[8:], y[8:]) and not torch.equal(y2[7], y[7])
    assert LL.layer_norm_linear(x[:0], nw, None, 1e-5, w, b).shape == (0, 40)
    assert torch.equal(LL.covered_layer_norm_linear(x, nw, None, 1e-5, w, b), y)


def test_an_odd_row_count_is_taken_and_the_column_sums_are_kept_per_weight():
    x, nw, w, b = _operands(9, 32, 23, torch.float32, True, seed=2)  # no gate halves: any N
    LG._COLSUMS.clear()
    y = LL.layer_norm_linear(x, nw, None, 1e-5, w, b)
    torch.testing.assert_close(y, _want(x, nw, w, b)[0], rtol=1e-4, atol=1e-4)
    assert LG._COLSUMS.holds(w) and LG._colsums(w, nw).shape == (23,)
    with torch.no_grad():
        w.mul_(-2)  # an in-place update: the sums are made again, not read stale
    torch.testing.assert_close(LL.layer_norm_linear(x, nw, None, 1e-5, w, b), _want(x, nw, w, b)[0],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_column_sums_kernel_is_an_fp32_product_read_in_the_weights_dtype(dtype):
    # rows and K past one block each (masked tails), then a strided weight; inference tensors keep
    # nothing, so every call runs the kernel
    for N, K, cols in ((45, 300, 300), (7, 16, 24)):
        w = torch.randn(N, cols, generator=torch.Generator().manual_seed(N)).to(dtype)[:, :K]
        nw = (torch.rand(K, generator=torch.Generator().manual_seed(K)) + 0.5).to(dtype)
        with torch.inference_mode():
            got = LG._colsums(w, nw.clone())
        assert got.dtype == torch.float32 and got.shape == (N,)
        torch.testing.assert_close(got, w.double() @ nw.double(), rtol=1e-5, atol=1e-4, check_dtype=False)
    assert LG._colsums(torch.empty(0, 8), torch.ones(8)).shape == (0,)


def test_bad_input_is_a_clear_error():
    x, nw, w, b = _operands(5, 16, 12, torch.float32, True)
    with pytest.raises(InputError, match="bias"):
        LL.layer_norm_linear(x, nw, torch.zeros(16), 1e-5, w, b)  # a norm bias: the parts take it
    with pytest.raises(InputError, match="norm weight"):
        LL.layer_norm_linear(x, nw[:-1], None, 1e-5, w, b)
    with pytest.raises(InputError, match="norm weight"):
        LL.layer_norm_linear(x, nw.half(), None, 1e-5, w, b)
    with pytest.raises(InputError, match="forward only"):
        LL.layer_norm_linear(x, nw, None, 1e-5, w.clone().requires_grad_(), b)
    with pytest.raises(InputError, match=r"expected \(T, D\) @ \(D, N\)"):
        LL.layer_norm_linear(x, nw, None, 1e-5, w[:, :-1], None)
    with pytest.raises(InputError, match="bias"):
        LL.layer_norm_linear(x, nw, None, 1e-5, w, b[:-1])
    with pytest.raises(InputError, match="share a dtype"):
        LL.layer_norm_linear(x, nw, None, 1e-5, w.double(), None)
    with pytest.raises(InputError, match="float16, bfloat16 or float32"):
        LL.layer_norm_linear(x.double(), nw.double(), None, 1e-5, w.double(), None)
    xh, nwh, wh, _ = _operands(5, 16, 12, torch.float16, False)
    assert not LL.covers_layer_norm_linear(xh, nwh, None, 1e-5, wh)  # CPU tensors: the parts


def test_modernbert_inference_calls_it_for_every_layer_after_the_first():
    from tests.kernels.test_ops_table import _tiny_modernbert

    params = _tiny_modernbert()
    b = pe.pack([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]])
    ops = get_ops("reference", "cpu")
    calls = []

    def spy(x, nw, nb, eps, w, bias=None):
        calls.append((tuple(x.shape), tuple(w.shape), nb is None, eps))
        return reference.layer_norm_linear(x, nw, nb, eps, w, bias)

    spied = dataclasses.replace(ops, layer_norm_linear=spy)
    with torch.inference_mode():
        out = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend=spied)
        assert torch.equal(out, pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend=ops))
    # layer 0 has no attn_norm (the embedding norm did it); layer 1 normalises the residual stream
    assert calls == [((11, 32), (96, 32), True, params.config.norm_eps)]  # (T, D), Wqkv (3D, D)
    calls.clear()
    pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend=spied)  # with autograd on: the carry, no call
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3584, 768, 2304), (1000, 760, 1000)])
def test_gpu_fused_in_inference_parts_with_gradients_two_x_rule(shape):
    T, D, N = shape  # ModernBERT-base's attn_norm and Wqkv; then K and N off the tiles
    ops = get_ops("triton", "cuda")
    assert dict(ops.chosen)["layer_norm_linear"] == "triton>layer_norm+linear"
    x, nw, w, _ = _operands(T, D, N, torch.bfloat16, False, device="cuda")
    want, parts = _want(x, nw, w, None)
    with torch.inference_mode():
        assert LL.covers_layer_norm_linear(x, nw, None, 1e-5, w)
        y = ops.layer_norm_linear(x, nw, None, 1e-5, w, None)
    assert_close_to_ref(y, want, parts, atol=1e-3, what="fused layer_norm_linear")
    assert torch.equal(y, LL.layer_norm_linear(x, nw, None, 1e-5, w))  # deterministic
    leaves = [t.clone().requires_grad_() for t in (x, nw, w)]  # with gradients: the parts, with their backward
    assert not LL.covers_layer_norm_linear(leaves[0], leaves[1], None, 1e-5, leaves[2])
    got = ops.layer_norm_linear(leaves[0], leaves[1], None, 1e-5, leaves[2], None)
    assert_close_to_ref(got.detach(), want, parts, atol=1e-3, what="parts layer_norm_linear")
    assert all(g is not None for g in torch.autograd.grad(got.float().sum(), leaves))
