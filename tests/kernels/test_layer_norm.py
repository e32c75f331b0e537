"""layer_norm, add_layer_norm, embed_layer_norm: Triton kernels and registered ops vs the reference.

Without a GPU the kernels run under TRITON_INTERPRET=1 on tiny ragged packs (fp32, fp16); the
`gpu` tests use the issue's ragged lengths in bf16 / fp16 / fp32 with the 2x rule.
"""

import pytest
import torch

from packedenc.errors import InputError
from packedenc.kernels import reference
from packedenc.kernels.reference import backward as reference_bwd
from packedenc.kernels.triton import layer_norm as LN
from packedenc.kernels.triton import layer_norm_kernels as L
from tests.kernels._assert import (
    CPU_LENGTHS, DEVICE, GPU_LENGTHS, assert_close_to_ref, other_rows,
)

T_CPU = sum(CPU_LENGTHS)


def _inputs(T, D, dtype, device=DEVICE, bias=True, scale=1.0):
    x = (torch.randn(T, D) * scale + 0.5).to(device, dtype)
    w = (1 + 0.1 * torch.randn(D)).to(device, dtype)
    b = (0.1 * torch.randn(D)).to(device, dtype) if bias else None
    return x, w, b


def _f32(*ts):
    return [None if t is None else t.float() for t in ts]


def _bwd(*args, **kw):
    """ln_bwd as (dx, dweight, dbias or None[, d x_bias]) in the weight's dtype, like the reference."""
    dx, sums = L.ln_bwd(*args, **kw)
    w = args[2]
    g = list(sums.to(w.dtype).unbind(0))
    need_db, need_dxb = kw.get("need_db", True), kw.get("need_dxb", False)
    assert sums.dtype == torch.float32 and sums.shape == (1 + need_db + need_dxb, w.shape[0])
    out = [dx, g[0], g[1] if need_db else None]
    return (*out, g[-1]) if need_dxb else tuple(out)


@pytest.mark.parametrize("D", [40, 64])  # 40: masked tail of a 64-wide block; 64: exact block
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_matches_reference(D, dtype, bias):
    x, w, b = _inputs(T_CPU, D, dtype, bias=bias)
    y, s = L.ln_fwd(x, w, b, 1e-5)
    assert s is None
    assert_close_to_ref(y, reference.layer_norm(*_f32(x, w, b), 1e-5), reference.layer_norm(x, w, b, 1e-5),
                        atol=2e-6, what="layer_norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_layer_norm_rounds_the_sum_first(dtype):
    x, w, b = _inputs(T_CPU, 40, dtype)
    r = torch.randn(T_CPU, 40).to(DEVICE, dtype) * 3
    y, s = L.ln_fwd(x, w, b, 1e-5, residual=r)
    y_ref, s_ref = reference.add_layer_norm(x, r, w, b, 1e-5)
    assert torch.equal(s, s_ref)  # the new residual is exactly the eager rounded sum
    assert_close_to_ref(y, reference.layer_norm(*_f32(s_ref, w, b), 1e-5), y_ref, atol=2e-6, what="add_layer_norm")
    # post-LN layers drop the sum: the kernel then does not write it, y is the same bits
    y2, none = L.ln_fwd(x, w, b, 1e-5, residual=r, keep_sum=False)
    assert none is None and torch.equal(y2, y)
    for fn in (LN.add_layer_norm, reference.add_layer_norm):
        y3, none = fn(x, r, w, b, 1e-5, keep_sum=False)
        assert none is None and torch.equal(y3, fn(x, r, w, b, 1e-5)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("keep_sum", [True, False])
def test_add_layer_norm_in_place_writes_into_its_inputs(dtype, keep_sum):
    x, w, b = _inputs(T_CPU, 40, dtype)
    r = torch.randn(T_CPU, 40).to(DEVICE, dtype) * 3
    want_y, want_s = L.ln_fwd(x, w, b, 1e-5, residual=r)
    x1, r1 = x.clone(), r.clone()
    y, s = L.ln_fwd(x1, w, b, 1e-5, residual=r1, keep_sum=keep_sum, in_place=True)
    assert y.data_ptr() == x1.data_ptr() and torch.equal(y, want_y)  # no allocation: y is x's memory
    if keep_sum:
        assert s.data_ptr() == r1.data_ptr() and torch.equal(s, want_s)
    else:
        assert s is None and torch.equal(r1, r)  # nothing asked to be written there
    # a column-major x cannot take the outputs: new tensors, and both inputs stay as they were
    xc, rc = x.t().contiguous().t(), r.clone()
    y, s = L.ln_fwd(xc, w, b, 1e-5, residual=rc, in_place=True)
    assert y.data_ptr() != xc.data_ptr() and torch.equal(xc, x) and torch.equal(rc, r)
    assert torch.equal(y, want_y) and torch.equal(s, want_s)
    if dtype != torch.float32:  # mixed dtypes: the sum is formed in fp32, as `x + residual` would be
        y, s = L.ln_fwd(x.clone(), w, b, 1e-5, residual=r.float(), in_place=True)
        y_ref, s_ref = L.ln_fwd(x, w, b, 1e-5, residual=r.float())
        assert y.dtype == torch.float32 and torch.equal(y, y_ref) and torch.equal(s, s_ref)
    shared = torch.randn(2, T_CPU, 40).to(DEVICE, dtype)  # x and residual views of one buffer
    before = shared.clone()
    y, s = L.ln_fwd(shared[0], w, b, 1e-5, residual=shared[1], in_place=True)
    assert torch.equal(shared, before) and torch.equal(y, L.ln_fwd(before[0], w, b, 1e-5, residual=before[1])[0])


def test_the_add_layer_norm_op_takes_overwrite_input_on_every_path(monkeypatch):
    x, w, b = _inputs(T_CPU, 40, torch.float32)
    r = torch.randn(T_CPU, 40, device=DEVICE)
    want = reference.add_layer_norm(x, r, w, b, 1e-5)
    for fn in (LN.add_layer_norm, reference.add_layer_norm):  # CPU: the registered op / the reference
        got = fn(x.clone(), r.clone(), w, b, 1e-5, overwrite_input=True)
        assert all(torch.equal(g, h) for g, h in zip(got, want))
    monkeypatch.setattr(LN, "direct_launch", lambda *t: True)  # the eager CUDA path, on the interpreter
    x1, r1 = x.clone(), r.clone()
    y, s = LN.add_layer_norm(x1, r1, w, b, 1e-5, overwrite_input=True)
    assert y.data_ptr() == x1.data_ptr() and s.data_ptr() == r1.data_ptr()
    torch.testing.assert_close(y, want[0], atol=2e-6, rtol=1e-5)
    assert torch.equal(s, want[1])
    x0, r0 = x.clone(), r.clone()
    y, s = LN.add_layer_norm(x, r, w, b, 1e-5)  # without the flag: inputs untouched
    assert y.data_ptr() != x.data_ptr() and torch.equal(x, x0) and torch.equal(r, r0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_embed_layer_norm_gathers_rows(dtype):
    table, w, b = _inputs(11, 40, dtype)
    ids = torch.tensor([3, 0, 10, 5, 5, 7, 0]).to(DEVICE)  # repeats, first and last rows
    y, _ = L.ln_fwd(table, w, b, 1e-5, ids=ids)
    ref32 = reference.embed_layer_norm(ids, *_f32(table, w, b), 1e-5)
    assert_close_to_ref(y, ref32, reference.embed_layer_norm(ids, table, w, b, 1e-5), atol=2e-6, what="embed")


def test_rows_do_not_leak_across_sequences():
    x, w, b = _inputs(T_CPU, 40, torch.float32)
    r = torch.randn_like(x)
    y, s = L.ln_fwd(x, w, b, 1e-5, residual=r)
    other = other_rows(CPU_LENGTHS, 3)
    x2, r2 = x.clone(), r.clone()
    x2[other] *= 7.0
    r2[other] -= 3.0
    y2, s2 = L.ln_fwd(x2, w, b, 1e-5, residual=r2)
    assert torch.equal(y[~other], y2[~other]) and torch.equal(s[~other], s2[~other])
    assert not torch.equal(y[other], y2[other])  # the perturbation did reach the other rows


def test_forward_and_backward_are_deterministic():
    x, w, b = _inputs(T_CPU, 40, torch.float16)
    dy = torch.randn_like(x)
    assert torch.equal(L.ln_fwd(x, w, b, 1e-5)[0], L.ln_fwd(x, w, b, 1e-5)[0])
    a, c = L.ln_bwd(dy, x, w, 1e-5, need_dxb=True), L.ln_bwd(dy, x, w, 1e-5, need_dxb=True)
    assert all(torch.equal(u, v) for u, v in zip(a, c))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["plain", "dsum", "gather"])
@pytest.mark.parametrize("D", [40, 600])  # 40: 16-row tiles; 600: one 1024-wide row per tile
def test_backward_kernel_matches_reference_backward(dtype, mode, D):
    x, w, _ = _inputs(T_CPU, D, dtype)
    dy = torch.randn(T_CPU, D).to(DEVICE, dtype)
    dsum = torch.randn(T_CPU, D).to(DEVICE, dtype) if mode == "dsum" else None
    ids = torch.randint(0, T_CPU, (T_CPU,)).to(DEVICE) if mode == "gather" else None
    dx, dw, db = _bwd(dy, x, w, 1e-5, dsum=dsum, ids=ids)
    rows = x if ids is None else x[ids]
    ref = reference_bwd.layer_norm_bwd(dy, rows, w, 1e-5, dsum)
    ref32 = reference_bwd.layer_norm_bwd(*_f32(dy, rows, w), 1e-5, None if dsum is None else dsum.float())
    for name, got, r, r32 in zip(("dx", "dw", "db"), (dx, dw, db), ref, ref32):
        assert_close_to_ref(got, r32, r, atol=1e-5, what=name)


@pytest.mark.parametrize("programs", [1, 3])  # one program over every tile; 3 uneven ranges of 7 tiles
def test_backward_kernel_programs_own_several_tiles(programs):
    x, w, b = _inputs(T_CPU, 600, torch.float32)  # one row per tile: T_CPU = 20 tiles
    dy, dsum = torch.randn(T_CPU, 600).to(DEVICE), torch.randn(T_CPU, 600).to(DEVICE)
    got = _bwd(dy, x, w, 1e-5, dsum=dsum, need_dxb=True, programs=programs)
    want = reference_bwd.layer_norm_bwd(dy, x, w, 1e-5, dsum, need_dxb=True)
    for name, a, r in zip(("dx", "dw", "db", "dxb"), got, want):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=name)


def test_backward_kernel_without_dbias():
    """need_db=False (bias-free norms): no dbias work, the same dx and dweight bit for bit."""
    x, w, _ = _inputs(T_CPU, 40, torch.float32)
    dy, dsum = torch.randn(T_CPU, 40).to(DEVICE), torch.randn(T_CPU, 40).to(DEVICE)
    dx, dw, db = _bwd(dy, x, w, 1e-5, dsum=dsum, need_db=False)
    full = _bwd(dy, x, w, 1e-5, dsum=dsum)
    assert db is None and torch.equal(dx, full[0]) and torch.equal(dw, full[1])


# ---- x_bias: the bias of the GEMM before the add, fused into the sum ----------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_layer_norm_with_x_bias_rounds_the_three_term_sum_once(dtype):
    x, w, b = _inputs(T_CPU, 40, dtype)
    r = torch.randn(T_CPU, 40).to(DEVICE, dtype) * 3
    xb = (torch.randn(40) * 2).to(DEVICE, dtype)
    y, s = L.ln_fwd(x, w, b, 1e-5, residual=r, x_bias=xb)
    y_ref, s_ref = reference.add_layer_norm(x, r, w, b, 1e-5, x_bias=xb)
    assert torch.equal(s, s_ref)  # (x + x_bias) + residual in fp32, one rounding, in both
    assert torch.equal(s_ref, (x.float() + xb.float() + r.float()).to(dtype))
    assert not torch.equal(s, L.ln_fwd(x, w, b, 1e-5, residual=r)[1])  # the bias did arrive
    assert_close_to_ref(y, reference.layer_norm(*_f32(s_ref, w, b), 1e-5), y_ref, atol=2e-6, what="x_bias")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dsum", [False, True])
@pytest.mark.parametrize("need_db", [True, False])
@pytest.mark.parametrize("D", [40, 600])
def test_backward_kernel_x_bias_gradient_is_the_column_sum_of_dx(dtype, dsum, need_db, D):
    x, w, _ = _inputs(T_CPU, D, dtype)
    dy = torch.randn(T_CPU, D).to(DEVICE, dtype)
    ds = torch.randn(T_CPU, D).to(DEVICE, dtype) if dsum else None
    got = _bwd(dy, x, w, 1e-5, dsum=ds, need_db=need_db, need_dxb=True)
    ref = reference_bwd.layer_norm_bwd(dy, x, w, 1e-5, ds, need_dxb=True)
    ref32 = reference_bwd.layer_norm_bwd(*_f32(dy, x, w), 1e-5, None if ds is None else ds.float(), need_dxb=True)
    for name, a, r, r32 in zip(("dx", "dw", "db", "dxb"), got, ref, ref32):
        if name == "db" and not need_db:
            assert a is None
            continue
        assert_close_to_ref(a, r32, r, atol=1e-5, what=name)
    # the extra partial row leaves dx bit for bit (the (P, k, D) sum's order may depend on k)
    plain = _bwd(dy, x, w, 1e-5, dsum=ds, need_db=need_db)
    assert torch.equal(got[0], plain[0])
    for a, c in zip(got[1:3], plain[1:]):
        if c is None:
            assert a is None
        else:
            torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)


def test_reference_x_bias_gradient_is_autograd_of_the_reference():
    x, w, b = _inputs(7, 12, torch.float32, device="cpu")
    r, xb, dy, ds = torch.randn_like(x), torch.randn(12), torch.randn_like(x), torch.randn_like(x)
    leaves = [t.clone().requires_grad_() for t in (x, r, w, b, xb)]
    y, s = reference.add_layer_norm(*leaves[:4], 1e-5, x_bias=leaves[4])
    gx, gr, gw, gb, gxb = torch.autograd.grad((y, s), leaves, (dy, ds))
    dsum, dw, db, dxb = reference_bwd.layer_norm_bwd(dy, s.detach(), w, 1e-5, ds, need_dxb=True)
    for name, a, c in (("dx", dsum, gx), ("dres", dsum, gr), ("dw", dw, gw), ("db", db, gb), ("dxb", dxb, gxb)):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("fn", ["triton", "reference"])
def test_add_layer_norm_rejects_a_bad_x_bias(fn):
    add_ln = LN.add_layer_norm if fn == "triton" else reference.add_layer_norm
    x, w, b = _inputs(6, 8, torch.float32, device="cpu")
    r = torch.randn_like(x)
    cases = [
        (torch.randn(7), r"x_bias must have shape \(8,\)"),
        (torch.randn(1, 8), r"x_bias must have shape \(8,\)"),
        (torch.randn(8, dtype=torch.float16), r"x_bias is torch.float16 but x is torch.float32; cast it"),
        (torch.randn(8, device="meta"), "x_bias is on meta but x on cpu"),
        ([0.0] * 8, "x_bias must be a tensor or None"),
    ]
    for xb, msg in cases:
        with pytest.raises(InputError, match=msg):
            add_ln(x, r, w, b, 1e-5, x_bias=xb)


# ---- the registered ops (CPU: the reference implementation) --------------------------------------


def test_ops_pass_opcheck():
    x, w, b = _inputs(6, 8, torch.float32, device="cpu")
    r = torch.randn_like(x)
    table = torch.randn(5, 8)
    ids = torch.tensor([0, 4, 2, 2, 1, 3])
    for args in ((x, w, b, 1e-5), (x, w, None, 1e-5)):
        torch.library.opcheck(torch.ops.packedenc.layer_norm.default, [a.requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a for a in args])
    torch.library.opcheck(torch.ops.packedenc.add_layer_norm.default, (x, r, w, b, 1e-5))
    torch.library.opcheck(torch.ops.packedenc.add_layer_norm.default, (x, r, w, b, 1e-5, torch.randn(8)))
    torch.library.opcheck(torch.ops.packedenc.embed_layer_norm.default, (ids, table, w, b, 1e-5))
    for need_db in (True, False):  # the backward op: (dx, (1 + need_db + need_dxb, D) fp32 sums)
        for need_dxb in (False, True):
            args = (r.detach(), x.detach(), None, r.detach(), w.detach(), 1e-5, need_db, need_dxb)  # no double bwd
            torch.library.opcheck(torch.ops.packedenc.layer_norm_bwd.default, args)
            assert torch.ops.packedenc.layer_norm_bwd(*args)[1].shape == (1 + need_db + need_dxb, 8)


def test_op_gradients_equal_reference_autograd():
    x, w, b = _inputs(6, 8, torch.float32, device="cpu")
    r = torch.randn_like(x)
    table = torch.randn(5, 8)
    ids = torch.tensor([0, 4, 2, 2, 1, 3])

    def grads(fn, *leaves):
        leaves = [t.detach().clone().requires_grad_() for t in leaves]
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum((o * torch.linspace(-1, 2, o.numel()).view_as(o)).sum() for o in outs)
        return torch.autograd.grad(loss, leaves)

    pairs = [
        (lambda x, w, b: LN.layer_norm(x, w, b, 1e-5), lambda x, w, b: reference.layer_norm(x, w, b, 1e-5), (x, w, b)),
        (lambda x, r, w, b: LN.add_layer_norm(x, r, w, b, 1e-5), lambda x, r, w, b: reference.add_layer_norm(x, r, w, b, 1e-5), (x, r, w, b)),
        (lambda x, r, w, b, xb: LN.add_layer_norm(x, r, w, b, 1e-5, xb),
         lambda x, r, w, b, xb: reference.add_layer_norm(x, r, w, b, 1e-5, xb), (x, r, w, b, torch.randn(8))),
        (lambda x, r, w, xb: LN.add_layer_norm(x, r, w, None, 1e-5, xb),  # no norm bias: the sums are (dw, dxb)
         lambda x, r, w, xb: reference.add_layer_norm(x, r, w, None, 1e-5, xb), (x, r, w, torch.randn(8))),
        (lambda t, w, b: LN.embed_layer_norm(ids, t, w, b, 1e-5), lambda t, w, b: reference.embed_layer_norm(ids, t, w, b, 1e-5), (table, w, b)),
    ]
    for op, ref, leaves in pairs:
        for g, gr in zip(grads(op, *leaves), grads(ref, *leaves)):
            torch.testing.assert_close(g, gr, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("x_bias", [False, True])
@pytest.mark.parametrize("used", ["normed", "sum"])
def test_add_layer_norm_op_with_an_unused_output(used, x_bias):
    """The final norm's sum output is unused: its gradient is None in the backward (no zero-filled
    (T, D) tensor), and the gradients still equal the reference's (d x_bias too: the column sums
    of the sum's gradient when only the sum is used)."""
    x, w, b = _inputs(6, 8, torch.float32, device="cpu")
    r = torch.randn_like(x)
    cot = torch.randn_like(x)
    xb = torch.randn(8) if x_bias else None

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (x, r, w, b) + ((xb,) if x_bias else ())]
        y, s = fn(*leaves[:4], 1e-5, leaves[4] if x_bias else None)
        return torch.autograd.grad(y if used == "normed" else s, leaves, cot, allow_unused=True)

    got, want = grads(LN.add_layer_norm), grads(reference.add_layer_norm)
    for a, c in zip(got, want):
        assert (a is None) == (c is None)
        if a is not None:
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    if used == "sum":
        assert got[2] is None and torch.equal(got[0], cot)
        if x_bias:
            torch.testing.assert_close(got[4], cot.sum(0))


def test_ops_compile_fullgraph():
    x, w, b = _inputs(6, 8, torch.float32, device="cpu")
    r = torch.randn_like(x)

    def f(x, r):
        y, s = LN.add_layer_norm(x, r, w, b, 1e-5)
        y2, s2 = LN.add_layer_norm(y, s, w, b, 1e-5, x_bias=b)
        return LN.layer_norm(y2 + s2, w, None, 1e-5)

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x, r), f(x, r))


# ---- GPU -----------------------------------------------------------------------------------------

GPU_T = sum(GPU_LENGTHS)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [768, 1024])  # ModernBERT base / large widths (768: masked 1024 block)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_forward_ops(D, dtype):
    from packedenc.kernels import get_ops

    ops = get_ops("triton", "cuda")
    x, w, b = _inputs(GPU_T, D, dtype, device="cuda", scale=2.0)
    r = torch.randn(GPU_T, D, device="cuda").to(dtype)
    table, _, _ = _inputs(1000, D, dtype, device="cuda")
    ids = torch.randint(0, 1000, (GPU_T,), device="cuda")
    atol = 1e-5 if dtype == torch.float32 else 1e-3
    assert_close_to_ref(ops.layer_norm(x, w, b, 1e-5), reference.layer_norm(*_f32(x, w, b), 1e-5),
                        reference.layer_norm(x, w, b, 1e-5), atol=atol, what="layer_norm")
    y, s = ops.add_layer_norm(x, r, w, None, 1e-5)
    y_ref, s_ref = reference.add_layer_norm(x, r, w, None, 1e-5)
    assert torch.equal(s, s_ref)
    assert_close_to_ref(y, reference.layer_norm(*_f32(s_ref, w), None, 1e-5), y_ref, atol=atol, what="add_ln")
    xb = (torch.randn(D, device="cuda") * 2).to(dtype)  # the direct launch and the registered op
    for y, s in (ops.add_layer_norm(x, r, w, b, 1e-5, x_bias=xb), torch.ops.packedenc.add_layer_norm(x, r, w, b, 1e-5, xb)):
        y_ref, s_ref = reference.add_layer_norm(x, r, w, b, 1e-5, x_bias=xb)
        assert torch.equal(s, s_ref)  # one fp32 sum of three, one rounding, in both
        assert_close_to_ref(y, reference.layer_norm(*_f32(s_ref, w, b), 1e-5), y_ref, atol=atol, what="x_bias")
    assert_close_to_ref(ops.embed_layer_norm(ids, table, w, b, 1e-5),
                        reference.embed_layer_norm(ids, *_f32(table, w, b), 1e-5),
                        reference.embed_layer_norm(ids, table, w, b, 1e-5), atol=atol, what="embed_ln")
    assert torch.equal(ops.layer_norm(x, w, b, 1e-5), ops.layer_norm(x, w, b, 1e-5))  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [768, 512])  # 512: the graph transformer's width (x_bias of its projections)
def test_gpu_backward_ops(dtype, D):
    from packedenc.kernels import get_ops

    ops = get_ops("triton", "cuda")
    x, w, b = _inputs(GPU_T, D, dtype, device="cuda")
    r = torch.randn(GPU_T, D, device="cuda").to(dtype)
    xb = (0.5 * torch.randn(D, device="cuda")).to(dtype)
    g1, g2 = torch.randn(GPU_T, D, device="cuda").to(dtype), torch.randn(GPU_T, D, device="cuda").to(dtype)

    def grads(fn, cast, with_xb=False):
        leaves = [t.detach().to(cast).requires_grad_() for t in (x, r, w, b) + ((xb,) if with_xb else ())]
        y, s = fn(*leaves)
        return torch.autograd.grad((y, s), leaves, (g1.to(cast), g2.to(cast)))

    op = lambda x, r, w, b: ops.add_layer_norm(x, r, w, b, 1e-5)  # noqa: E731
    ref = lambda x, r, w, b: reference.add_layer_norm(x, r, w, b, 1e-5)  # noqa: E731
    got, lowp, f32 = grads(op, dtype), grads(ref, dtype), grads(ref, torch.float32)
    for name, a, c, e in zip(("dx", "dres", "dw", "db"), got, lowp, f32):
        assert_close_to_ref(a, e, c, atol=1e-4, what=name)
    assert all(torch.equal(a, c) for a, c in zip(got, grads(op, dtype)))  # deterministic

    op = lambda x, r, w, b, xb: ops.add_layer_norm(x, r, w, b, 1e-5, x_bias=xb)  # noqa: E731
    ref = lambda x, r, w, b, xb: reference.add_layer_norm(x, r, w, b, 1e-5, x_bias=xb)  # noqa: E731
    got, lowp, f32 = grads(op, dtype, True), grads(ref, dtype, True), grads(ref, torch.float32, True)
    for name, a, c, e in zip(("dx", "dres", "dw", "db", "dxb"), got, lowp, f32):
        assert_close_to_ref(a, e, c, atol=1e-4, what=f"x_bias {name}")
    assert all(torch.equal(a, c) for a, c in zip(got, grads(op, dtype, True)))  # deterministic

    table = torch.randn(1000, D, device="cuda").to(dtype)
    ids = torch.randint(0, 1000, (GPU_T,), device="cuda")

    def egrads(fn, cast):
        leaves = [t.detach().to(cast).requires_grad_() for t in (table, w, b)]
        return torch.autograd.grad(fn(ids, *leaves, 1e-5), leaves, g1.to(cast))

    got = egrads(ops.embed_layer_norm, dtype)
    lowp, f32 = egrads(reference.embed_layer_norm, dtype), egrads(reference.embed_layer_norm, torch.float32)
    for name, a, c, e in zip(("dtable", "dw", "db"), got, lowp, f32):
        assert_close_to_ref(a, e, c, atol=1e-4, what=name)


@pytest.mark.parametrize("shape", [(1, 5), (37, 2, 45), (70, 768)])  # P below, between and above the row chunk
def test_colsum_sums_partial_rows_in_a_fixed_order(shape):
    from packedenc.kernels.triton.colsum import colsum

    part = torch.randn(shape).to(DEVICE)
    got = colsum(part)
    assert got.shape == shape[1:] and got.dtype == torch.float32
    torch.testing.assert_close(got, part.double().sum(0).float(), rtol=1e-6, atol=1e-5)
    assert torch.equal(got, colsum(part.clone()))  # deterministic
    assert torch.equal(colsum(part[:0]), torch.zeros(shape[1:]).to(DEVICE))  # no rows: zeros
