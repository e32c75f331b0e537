"""`layer_norm_linear_glu`: the LayerNorm before a gated MLP's input projection read inside the GEMM
(`kernels/triton/linear_glu.py` with its NORM prologue), and the op's parts (the table's
`layer_norm`, then its `linear_glu`), which run every call the fused kernel does not take."""

import dataclasses

import pytest
import torch

import packedenc as pe
from packedenc.errors import ConfigError, InputError
from packedenc.kernels import choose, get_ops, reference
from packedenc.kernels.triton import glu as G
from packedenc.kernels.triton import linear_glu as LG
from tests.kernels._assert import assert_close_to_ref


def _operands(T, D, F, dtype, bias, device="cpu", seed=0, offset=0.5):
    """x with a mean off zero (`offset`: the kernel subtracts it after the dot), a norm weight
    around 1, Wi (2F, D), a bias or None."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(T, D, device=device, generator=g) * 2 + offset).to(dtype)
    nw = (torch.rand(D, device=device, generator=g) + 0.5).to(dtype)
    w = (torch.randn(2 * F, D, device=device, generator=g) / D**0.5).to(dtype)
    b = (torch.randn(2 * F, device=device, generator=g) / 4).to(dtype) if bias else None
    return x, nw, w, b


def _want(x, nw, w, b, act, eps=1e-5):
    """fp32 reference, and the parts in x's dtype (normalised rows rounded, then u rounded)."""
    f = [None if t is None else t.float() for t in (x, nw, w, b)]
    return (reference.layer_norm_linear_glu(f[0], f[1], None, eps, f[2], f[3], act),
            reference.layer_norm_linear_glu(x, nw, None, eps, w, b, act))


def test_the_reference_is_the_two_ops_it_replaces_and_the_parts_end_every_chain():
    x, nw, w, b = _operands(5, 16, 8, torch.float32, True)
    want = reference.linear_glu(reference.layer_norm(x, nw, None, 1e-6), w, b, "silu")
    assert torch.equal(reference.layer_norm_linear_glu(x, nw, None, 1e-6, w, b, "silu"), want)
    with pytest.raises(ConfigError, match="mish"):
        reference.layer_norm_linear_glu(x, nw, None, 1e-6, w, b, "mish")
    every = {"triton", "flash"}.__contains__
    assert choose("layer_norm_linear_glu", "reference", "cuda", every) == "layer_norm+linear_glu"
    assert choose("layer_norm_linear_glu", "triton", "cuda", every) == "triton>layer_norm+linear_glu"
    assert choose("layer_norm_linear_glu", "auto", "cuda", every) == "layer_norm+linear_glu"  # row not chosen yet
    assert choose("layer_norm_linear_glu", "auto", "cpu") == "layer_norm+linear_glu"
    # the parts are the table's own entries: its linear_glu (here the reference) after its layer_norm
    ops = get_ops("auto", "cpu")
    assert torch.equal(ops.layer_norm_linear_glu(x, nw, None, 1e-6, w, b, "silu"), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(9, 32, 24, LG.TILE), (37, 40, 40, (16, 16, 16, 4, 1))])
def test_fused_norm_gemm_matches_the_reference(dtype, bias, shape):
    T, D, F, tile = shape  # one tile with masked rows; several with masked rows, columns and a K tail
    x, nw, w, b = _operands(T, D, F, dtype, bias)
    for act, eps in (("gelu", 1e-5), ("silu", 1e-2)):
        y = LG.linear_glu_fwd(x, w, b, G._code(act), tile=tile, norm_weight=nw, eps=eps)
        assert y.shape == (T, F) and y.is_contiguous()
        want, parts = _want(x, nw, w, b, act, eps)
        if dtype == torch.float32:
            torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
        else:  # x * w rounded where the parts round the normalised rows, then u rounded as theirs
            assert_close_to_ref(y, want, parts, atol=1e-3, what=f"layer_norm_linear_glu {act}")


def test_fused_norm_gemm_rows_stay_in_their_row_and_the_table_entry_is_the_same_kernel():
    x, nw, w, b = _operands(21, 32, 24, torch.float32, True)
    y = LG.layer_norm_linear_glu(x, nw, None, 1e-5, w, b)
    x2 = x.clone()
    x2[7] = x2[7] * 3 + 1  # another row's statistics
    y2 = LG.layer_norm_linear_glu(x2, nw, None, 1e-5, w, b)
    assert torch.equal(y2[:7], y[:7]) and torch.equal(y2[8:], y[8:]) and not torch.equal(y2[7], y[7])
    assert LG.layer_norm_linear_glu(x[:0], nw, None, 1e-5, w, b).shape == (0, 24)
    assert torch.equal(LG.covered_layer_norm_linear_glu(x, nw, None, 1e-5, w, b), y)


def test_bad_input_is_a_clear_error():
    x, nw, w, b = _operands(5, 16, 8, torch.float32, True)
    with pytest.raises(InputError, match="bias"):
        LG.layer_norm_linear_glu(x, nw, torch.zeros(16), 1e-5, w, b)  # a norm bias: the parts take it
    with pytest.raises(InputError, match="norm weight"):
        LG.layer_norm_linear_glu(x, nw[:-1], None, 1e-5, w, b)
    with pytest.raises(InputError, match="norm weight"):
        LG.layer_norm_linear_glu(x, nw.half(), None, 1e-5, w, b)
    with pytest.raises(InputError, match="forward only"):
        LG.layer_norm_linear_glu(x, nw.clone().requires_grad_(), None, 1e-5, w, b)
    with pytest.raises(InputError, match="forward only"):
        LG.layer_norm_linear_glu(x.clone().requires_grad_(), nw, None, 1e-5, w, b)
    with pytest.raises(InputError, match="gate rows"):  # the GEMM's own checks
        LG.layer_norm_linear_glu(x, nw, None, 1e-5, w[:-1], None)
    with pytest.raises(ConfigError, match="mish"):
        LG.layer_norm_linear_glu(x, nw, None, 1e-5, w, b, "mish")
    xh, nwh, wh, _ = _operands(5, 16, 8, torch.float16, False)
    assert not LG.covers_layer_norm_linear_glu(xh, nwh, None, 1e-5, wh)  # CPU tensors: the parts


def test_modernbert_inference_calls_it_once_per_layer_on_the_residual_stream():
    from tests.kernels.test_ops_table import _tiny_modernbert

    params = _tiny_modernbert()
    b = pe.pack([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]])
    ops = get_ops("reference", "cpu")
    calls = []

    def spy(x, nw, nb, eps, w, bias=None, act="gelu"):
        calls.append((tuple(x.shape), tuple(w.shape), nb is None, eps, act))
        return reference.layer_norm_linear_glu(x, nw, nb, eps, w, bias, act)

    spied = dataclasses.replace(ops, layer_norm_linear_glu=spy)
    with torch.inference_mode():
        out = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend=spied)
        assert torch.equal(out, pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend=ops))
    eps = params.config.norm_eps
    assert calls == [((11, 32), (96, 32), True, eps, "gelu")] * 2  # (T, D), Wi (2F, D), per layer
    calls.clear()
    pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, backend=spied)  # with autograd on: the carry, no call
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4099, 768, 1152), (1000, 760, 1000)])
def test_gpu_fused_in_inference_parts_with_gradients_two_x_rule(shape):
    T, D, F = shape  # ModernBERT-base's mlp_norm and Wi; then K and F off the tiles
    ops = get_ops("triton", "cuda")
    assert dict(ops.chosen)["layer_norm_linear_glu"] == "triton>layer_norm+linear_glu"
    x, nw, w, _ = _operands(T, D, F, torch.bfloat16, False, device="cuda")
    want, parts = _want(x, nw, w, None, "gelu")
    with torch.inference_mode():
        assert LG.covers_layer_norm_linear_glu(x, nw, None, 1e-5, w)
        y = ops.layer_norm_linear_glu(x, nw, None, 1e-5, w, None, "gelu")
    assert_close_to_ref(y, want, parts, atol=1e-3, what="fused layer_norm_linear_glu")
    assert torch.equal(y, LG.layer_norm_linear_glu(x, nw, None, 1e-5, w))  # deterministic
    leaves = [t.clone().requires_grad_() for t in (x, nw, w)]  # with gradients: the parts, with their backward
    assert not LG.covers_layer_norm_linear_glu(leaves[0], leaves[1], None, 1e-5, leaves[2])
    got = ops.layer_norm_linear_glu(leaves[0], leaves[1], None, 1e-5, leaves[2], None, "gelu")
    assert_close_to_ref(got.detach(), want, parts, atol=1e-3, what="parts layer_norm_linear_glu")
    assert all(g is not None for g in torch.autograd.grad(got.float().sum(), leaves))


def test_the_column_sums_are_kept_per_weight_and_made_again_after_an_update():
    x, nw, w, b = _operands(9, 32, 24, torch.float32, True, seed=3)
    LG._COLSUMS.clear()
    y = LG.layer_norm_linear_glu(x, nw, None, 1e-5, w, b)
    assert LG._COLSUMS.holds(w) and len(LG._COLSUMS) == 1
    kept = LG._colsums(w, nw)
    assert kept is LG._colsums(w, nw) and torch.allclose(kept, w.float() @ nw.float())
    with torch.no_grad():
        w.mul_(-2)  # an optimizer step / copy_: the sums are made again, not read stale
        nw2 = nw.clone()
    torch.testing.assert_close(LG.layer_norm_linear_glu(x, nw, None, 1e-5, w, b),
                               _want(x, nw, w, b, "gelu")[0], rtol=1e-4, atol=1e-4)
    assert not torch.equal(LG.layer_norm_linear_glu(x, nw, None, 1e-5, w, b), y)
    torch.testing.assert_close(LG.layer_norm_linear_glu(x, nw2 * 0 + 1, None, 1e-5, w, b),
                               _want(x, nw2 * 0 + 1, w, b, "gelu")[0], rtol=1e-4, atol=1e-4)  # another norm weight
    with torch.inference_mode():  # inference tensors keep no version: made per call, never kept
        xi, nwi, wi, bi = (t.clone() for t in (x, nw, w, b))
        assert LG._colsums(wi, nwi) is not LG._colsums(wi, nwi) and not LG._COLSUMS.holds(wi)
        torch.testing.assert_close(LG.layer_norm_linear_glu(xi, nwi, None, 1e-5, wi, bi),
                                   _want(x, nw, w, b, "gelu")[0], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_column_sums_are_kept_eagerly_and_made_inside_a_graph_capture():
    x, nw, w, _ = _operands(3584, 768, 1152, torch.bfloat16, False, device="cuda", seed=5)
    LG._COLSUMS.clear()
    with torch.inference_mode():
        eager = LG.layer_norm_linear_glu(x, nw, None, 1e-5, w)
        assert LG._COLSUMS.holds(w)
        w2, nw2 = w.flip(0).contiguous(), (nw * 0.5).contiguous()  # never seen eagerly
        want2 = LG.layer_norm_linear_glu(x, nw2, None, 1e-5, w2)
        LG._COLSUMS.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = LG.layer_norm_linear_glu(x, nw, None, 1e-5, w)
            out2 = LG.layer_norm_linear_glu(x, nw2, None, 1e-5, w2)
        assert len(LG._COLSUMS) == 0  # nothing from the graph's pool is kept
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(out2, want2)
