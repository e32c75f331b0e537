"""Triton activation: act(x) for every activation of reference._ACTS, forward and backward.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py), called through their
launchers (`activation_fwd` / `activation_bwd`): the registered op's CPU implementation is the
reference, so the Ops-table function itself only reaches the kernels on a GPU (the `gpu` tests).
"""

import pytest
import torch

from packedenc.errors import ConfigError, InputError
from packedenc.kernels import reference
from packedenc.kernels.reference import backward as reference_bwd
from packedenc.kernels.triton import activation as A
from tests.kernels._assert import CPU_LENGTHS, DEVICE, GPU_LENGTHS, assert_close_to_ref

T_CPU = sum(CPU_LENGTHS)  # 20 ragged rows
ACTS = sorted(reference.ACTIVATIONS)


def _ref_grad(x, dy, act):
    """d(sum(act(x) * dy))/dx through torch.autograd of the reference, in x's dtype."""
    leaf = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(reference.activation(leaf, act), leaf, dy)
    return g


def _ref_bias_grads(x, b, dy, act):
    """(dx, dbias) of sum(act(x + b) * dy) through torch.autograd of the reference."""
    leaves = [x.detach().requires_grad_(), b.detach().requires_grad_()]
    return torch.autograd.grad(reference.activation(leaves[0], act, bias=leaves[1]), leaves, dy)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_activation_forward_and_backward_match_reference(act, dtype):
    # 20 x 40 = 800 elements in blocks of 64: 13 programs, the last one 32 elements short.
    x = (torch.randn(T_CPU, 40) * 3).to(DEVICE, dtype)
    dy = torch.randn(T_CPU, 40).to(DEVICE, dtype)
    y = A.activation_fwd(x, act, block=64)
    assert_close_to_ref(y, reference.activation(x.float(), act), reference.activation(x, act), atol=1e-6, what=act)
    dx = A.activation_bwd(dy, x, act, block=64)
    assert_close_to_ref(dx, _ref_grad(x.float(), dy.float(), act), _ref_grad(x, dy, act), atol=2e-6,
                        what=f"d{act}")


def test_activation_default_block_tail_and_shapes():
    """The shipped 1024-element block on 1440 elements (a masked tail), a 3-D and a strided input."""
    x = torch.randn(2, 9, 80).to(DEVICE, torch.float16)
    y = A.activation_fwd(x, "gelu")
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close_to_ref(y, reference.activation(x.float(), "gelu"), reference.activation(x, "gelu"), atol=1e-6)
    xt = x[0].t()  # (80, 9), not contiguous: copied to rows first, same values
    assert torch.equal(A.activation_fwd(xt, "gelu"), y[0].t())
    dy = torch.randn(80, 9).to(DEVICE, torch.float16)
    assert torch.equal(A.activation_bwd(dy, xt, "gelu"), A.activation_bwd(dy, xt.contiguous(), "gelu"))


def test_activation_empty_and_determinism():
    e = torch.empty(0, 16).to(DEVICE)
    assert A.activation_fwd(e, "silu").shape == (0, 16)
    assert A.activation_bwd(e, e, "silu").shape == (0, 16)
    x = torch.randn(T_CPU, 24).to(DEVICE, torch.float16)
    assert torch.equal(A.activation_fwd(x, "gelu_new"), A.activation_fwd(x, "gelu_new"))


def test_activation_kernel_sees_only_its_elements():
    """Changing other rows changes nothing here (no cross-element reads)."""
    x = torch.randn(T_CPU, 24).to(DEVICE)
    x2 = x.clone()
    x2[5:] *= -2
    y, y2 = A.activation_fwd(x, "gelu", block=64), A.activation_fwd(x2, "gelu", block=64)
    assert torch.equal(y[:5], y2[:5]) and not torch.equal(y[5:], y2[5:])


def test_reference_activation_bwd_is_autograd_of_the_reference():
    x, dy = torch.randn(7, 12) * 3, torch.randn(7, 12)
    for act in ACTS:
        torch.testing.assert_close(reference_bwd.activation_bwd(dy, x, act), _ref_grad(x, dy, act), msg=act)


@pytest.mark.parametrize("bad", ["int", "act"])
@pytest.mark.parametrize("fn", ["op", "fwd", "bwd"])
def test_activation_rejects_bad_input(bad, fn):
    x = torch.randint(0, 5, (4, 8)) if bad == "int" else torch.randn(4, 8)
    act = "gelu" if bad == "int" else "mish"
    call = {"op": lambda: A.activation(x, act), "fwd": lambda: A.activation_fwd(x, act),
            "bwd": lambda: A.activation_bwd(x, x, act)}[fn]
    err, match = (TypeError, "expected float16, bfloat16 or float32") if bad == "int" else (ConfigError, "'mish'")
    with pytest.raises(err, match=match):
        call()


def test_activation_op_opcheck_autograd_and_compile():
    x = torch.randn(5, 16)
    for act in ("gelu", "linear"):  # "linear": the op's output must not alias its input
        torch.library.opcheck(torch.ops.packedenc.activation.default, (x.clone().requires_grad_(), act))
    torch.library.opcheck(torch.ops.packedenc.activation_bwd.default, (torch.randn(5, 16), x, "silu"))
    w = torch.randn(5, 16)
    for act in ("silu", "gelu", "tanh"):
        a = x.clone().requires_grad_()
        (A.activation(a, act) * w).sum().backward()
        torch.testing.assert_close(a.grad, _ref_grad(x, w, act), msg=act)
    assert A.activation(x, "linear") is x  # identity without a kernel, like the fp32 reference
    f = lambda t: A.activation(t, "gelu_new")  # noqa: E731
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x))


# ---- GPU: bigger shapes, every activation, through the Ops table --------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("act", ACTS)
def test_gpu_activation(dtype, act):
    from packedenc.kernels import get_ops

    ops = get_ops("auto", "cuda")
    assert dict(ops.chosen)["activation"] == "triton"
    T, F = sum(GPU_LENGTHS), 3072  # DeBERTa-v3-base / BERT-base intermediate size
    x = (torch.randn(T, F, device="cuda") * 3).to(dtype)
    dy = torch.randn(T, F, device="cuda").to(dtype)
    atol = 1e-5 if dtype == torch.float32 else 1e-3
    y = ops.activation(x, act)  # eager, no grad: the direct launch
    assert_close_to_ref(y, reference.activation(x.float(), act), reference.activation(x, act), atol=atol, what=act)
    assert torch.equal(ops.activation(x, act), y)  # deterministic
    if act != "linear":  # the registered op (compile / autograd path) runs the same kernel
        assert torch.equal(torch.ops.packedenc.activation(x, act), y)
    leaf = x.detach().requires_grad_()
    ops.activation(leaf, act).backward(dy)
    assert_close_to_ref(leaf.grad, _ref_grad(x.float(), dy.float(), act), _ref_grad(x, dy, act), atol=atol,
                        what=f"d{act}")


@pytest.mark.gpu
def test_gpu_activation_memory_compile_and_graph():
    """One output-sized allocation (the reference makes two fp32 temporaries); compile; graph replay."""
    from packedenc.kernels import get_ops

    ops = get_ops("auto", "cuda")
    x = torch.randn(8192, 3072, device="cuda", dtype=torch.bfloat16)
    y = ops.activation(x, "gelu")
    torch.cuda.synchronize()
    del y
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    y = ops.activation(x, "gelu")
    assert torch.cuda.max_memory_allocated() - before <= x.numel() * x.element_size() + (1 << 20)
    f = torch.compile(lambda t: ops.activation(t, "gelu"), fullgraph=True)
    assert torch.equal(f(x), y)
    static = x[:512].clone()
    ops.activation(static, "gelu")  # warm-up outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.activation(static, "gelu")
    static.copy_(x[512:1024])
    g.replay()
    assert torch.equal(out, y[512:1024])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_activation_overwrite_input_writes_over_x_in_eager_inference(dtype, monkeypatch):
    monkeypatch.setattr(A, "direct_launch", lambda *ts: True)  # the eager CUDA inference branch
    x = (torch.randn(T_CPU, 40) * 3).to(DEVICE, dtype)
    want = A.activation_fwd(x, "gelu")
    kept = x.clone()
    assert torch.equal(A.activation(kept, "gelu"), want) and torch.equal(kept, x)  # default: input untouched
    y = A.activation(x, "gelu", overwrite_input=True)
    assert y.data_ptr() == x.data_ptr() and torch.equal(y, want) and torch.equal(x, want)
    # a non-contiguous x is not overwritten (its contiguous copy is)
    xt = (torch.randn(40, T_CPU) * 3).to(DEVICE, dtype).t()
    before = xt.clone()
    out = A.activation(xt, "gelu", overwrite_input=True)
    assert torch.equal(xt, before) and torch.equal(out, A.activation_fwd(before, "gelu"))


# ---- with a fused bias: act(x + bias), dbias from the backward kernel ----------------------------


def _bias_inputs(T, F, dtype, device=DEVICE):
    x = (torch.randn(T, F) * 3).to(device, dtype)
    b = torch.randn(F).to(device, dtype)
    return x, b, torch.randn(T, F).to(device, dtype)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bias_activation_forward_and_backward_match_reference(act, dtype):
    # (20, 40) in 4 x 16 tiles: 3 column blocks, the last one half masked; 5 row tiles in 2 ranges
    # of 3 (the second one runs past T): the partial column sums and their one torch sum.
    x, b, dy = _bias_inputs(T_CPU, 40, dtype)
    y = A.bias_activation_fwd(x, b, act, tile=(4, 16))
    ref32 = reference.activation(x.float(), act, bias=b.float())
    assert_close_to_ref(y, ref32, reference.activation(x, act, bias=b), atol=1e-6, what=act)
    dx, db = A.bias_activation_bwd(dy, x, b, act, tile=(4, 16), programs=2)
    (dx32, db32), (dxl, dbl) = _ref_bias_grads(x.float(), b.float(), dy.float(), act), _ref_bias_grads(x, b, dy, act)
    assert_close_to_ref(dx, dx32, dxl, atol=2e-6, what=f"d{act}")
    assert_close_to_ref(db, db32, dbl, atol=2e-6, what=f"dbias {act}")
    rdx, rdb = reference_bwd.bias_activation_bwd(dy, x, b, act)  # the CPU op's implementation
    assert_close_to_ref(rdx, dx32, dxl, atol=2e-6, what=f"reference d{act}")
    assert_close_to_ref(rdb, db32, dbl, atol=2e-6, what=f"reference dbias {act}")


@pytest.mark.parametrize("programs", [1, 3, 1024])  # one range; uneven ranges; one tile per range
def test_bias_activation_backward_partitions_and_determinism(programs):
    x, b, dy = _bias_inputs(T_CPU, 24, torch.float32)
    dx, db = A.bias_activation_bwd(dy, x, b, "gelu", tile=(2, 8), programs=programs)
    want_dx, want_db = _ref_bias_grads(x, b, dy, "gelu")
    torch.testing.assert_close(dx, want_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db, want_db, rtol=1e-5, atol=1e-5)
    again = A.bias_activation_bwd(dy, x, b, "gelu", tile=(2, 8), programs=programs)
    assert torch.equal(dx, again[0]) and torch.equal(db, again[1])  # no atomics: bit for bit


def test_bias_activation_default_tile_shapes_and_empty():
    """The shipped tile on a 3-D input with a masked column tail; a non-contiguous input; no rows."""
    x = (torch.randn(2, 9, 80) * 3).to(DEVICE, torch.float16)
    b = torch.randn(80).to(DEVICE, torch.float16)
    y = A.bias_activation_fwd(x, b, "silu")
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y, A.bias_activation_fwd(x.reshape(18, 80), b, "silu", tile=(4, 32)).view_as(x))
    dy = torch.randn(2, 9, 80).to(DEVICE, torch.float16)
    dx, db = A.bias_activation_bwd(dy, x, b, "silu")
    assert dx.shape == x.shape and db.shape == (80,) and db.dtype == torch.float16
    xt = (torch.randn(80, 9) * 3).to(DEVICE).t()  # (9, 80), not contiguous: copied to rows first
    bt = torch.randn(80).to(DEVICE)
    assert torch.equal(A.bias_activation_fwd(xt, bt, "gelu"), A.bias_activation_fwd(xt.contiguous(), bt, "gelu"))
    e = torch.empty(0, 16).to(DEVICE)
    assert A.bias_activation_fwd(e, torch.zeros(16).to(DEVICE), "gelu").shape == (0, 16)
    dx, db = A.bias_activation_bwd(e, e, torch.zeros(16).to(DEVICE), "gelu")
    assert dx.shape == (0, 16) and torch.equal(db, torch.zeros(16).to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bias_activation_overwrite_input_in_eager_inference(dtype, monkeypatch):
    monkeypatch.setattr(A, "direct_launch", lambda *ts: True)  # the eager CUDA inference branch
    x, b, _ = _bias_inputs(T_CPU, 40, dtype)
    want = A.bias_activation_fwd(x, b, "gelu")
    kept = x.clone()
    assert torch.equal(A.activation(kept, "gelu", bias=b), want) and torch.equal(kept, x)  # input untouched
    y = A.activation(x, "gelu", overwrite_input=True, bias=b)
    assert y.data_ptr() == x.data_ptr() and torch.equal(x, want)
    xt = (torch.randn(40, T_CPU) * 3).to(DEVICE, dtype).t()  # not contiguous: its copy is overwritten
    before = xt.clone()
    out = A.activation(xt, "gelu", overwrite_input=True, bias=b)
    assert torch.equal(xt, before) and torch.equal(out, A.bias_activation_fwd(before, b, "gelu"))


def test_bias_activation_op_opcheck_autograd_and_compile():
    x, b, w = torch.randn(5, 16), torch.randn(16), torch.randn(5, 16)
    for act in ("gelu", "linear"):  # "linear": x + b, and its dx (= dy) must not alias dy
        torch.library.opcheck(torch.ops.packedenc.bias_activation.default,
                              (x.clone().requires_grad_(), b.clone().requires_grad_(), act))
        torch.library.opcheck(torch.ops.packedenc.bias_activation_bwd.default, (torch.randn(5, 16), x, b, act))
    for act in ("silu", "gelu", "tanh", "linear"):
        a, c = x.clone().requires_grad_(), b.clone().requires_grad_()
        (A.activation(a, act, bias=c) * w).sum().backward()
        want_dx, want_db = _ref_bias_grads(x, b, w, act)
        torch.testing.assert_close(a.grad, want_dx, msg=act)
        torch.testing.assert_close(c.grad, want_db, msg=act)
    torch.testing.assert_close(A.activation(x, "linear", bias=b), x + b)
    f = lambda t, c: A.activation(t, "gelu_new", bias=c)  # noqa: E731
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x, b), f(x, b))


@pytest.mark.parametrize("fn", ["op", "reference", "fwd", "bwd"])
def test_activation_rejects_a_bad_bias(fn):
    x = torch.randn(4, 8)
    call = {"op": lambda b: A.activation(x, "gelu", bias=b),
            "reference": lambda b: reference.activation(x, "gelu", bias=b),
            "fwd": lambda b: A.bias_activation_fwd(x, b, "gelu"),
            "bwd": lambda b: A.bias_activation_bwd(x, x, b, "gelu")}[fn]
    cases = [
        (torch.randn(4), r"activation: bias must have shape \(8,\)"),
        (torch.randn(4, 8), r"bias must have shape \(8,\) \(the last dim of x, \(4, 8\)\), got \(4, 8\)"),
        (torch.randn(8, dtype=torch.float16), r"bias is torch.float16 but x is torch.float32; cast it"),
        (torch.randn(8, device="meta"), "bias is on meta but x on cpu"),
        (1.0, "bias must be a tensor or None"),
    ]
    for b, msg in cases:
        with pytest.raises(InputError, match=msg):
            call(b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu", "silu", "linear"])
@pytest.mark.parametrize("F", [2048, 1000])  # the issue-6 FFN width; a masked column block
def test_gpu_bias_activation(dtype, act, F):
    from packedenc.kernels import get_ops

    ops = get_ops("auto", "cuda")
    T = sum(GPU_LENGTHS)
    x, b, dy = _bias_inputs(T, F, dtype, device="cuda")
    atol = 1e-5 if dtype == torch.float32 else 1e-3
    y = ops.activation(x, act, bias=b)  # eager, no grad: the direct launch
    ref32 = reference.activation(x.float(), act, bias=b.float())
    assert_close_to_ref(y, ref32, reference.activation(x, act, bias=b), atol=atol, what=act)
    assert torch.equal(torch.ops.packedenc.bias_activation(x, b, act), y)  # the registered op: same kernel
    kept = x.clone()
    assert torch.equal(ops.activation(kept, act, overwrite_input=True, bias=b), y) and torch.equal(kept, y)
    (dx32, db32), (dxl, dbl) = _ref_bias_grads(x.float(), b.float(), dy.float(), act), _ref_bias_grads(x, b, dy, act)

    def grads():
        leaves = [x.detach().requires_grad_(), b.detach().requires_grad_()]
        return torch.autograd.grad(ops.activation(leaves[0], act, bias=leaves[1]), leaves, dy)

    dx, db = grads()
    assert_close_to_ref(dx, dx32, dxl, atol=atol, what=f"d{act}")
    assert_close_to_ref(db, db32, dbl, atol=atol, what=f"dbias {act}")
    assert all(torch.equal(a, c) for a, c in zip((dx, db), grads()))  # deterministic


@pytest.mark.gpu
def test_gpu_bias_activation_compile_and_graph():
    from packedenc.kernels import get_ops

    ops = get_ops("auto", "cuda")
    x, b, _ = _bias_inputs(4096, 2048, torch.bfloat16, device="cuda")
    y = ops.activation(x, "gelu", bias=b)
    f = torch.compile(lambda t, c: ops.activation(t, "gelu", bias=c), fullgraph=True)
    assert torch.equal(f(x, b), y)
    static = x[:512].clone()
    ops.activation(static, "gelu", bias=b)  # warm-up outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.activation(static, "gelu", bias=b)
    static.copy_(x[512:1024])
    g.replay()
    assert torch.equal(out, y[512:1024])
