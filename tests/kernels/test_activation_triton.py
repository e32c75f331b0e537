"""Triton activation: act(x) for every activation of reference._ACTS, forward and backward.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py), called through their
launchers (`activation_fwd` / `activation_bwd`): the registered op's CPU implementation is the
reference, so the Ops-table function itself only reaches the kernels on a GPU (the `gpu` tests).
"""

import pytest
import torch

from packedenc.errors import ConfigError
from packedenc.kernels import reference, reference_bwd
from packedenc.kernels.triton import activation as A
from tests.kernels._assert import CPU_LENGTHS, DEVICE, GPU_LENGTHS, assert_close_to_ref

T_CPU = sum(CPU_LENGTHS)  # 20 ragged rows
ACTS = sorted(reference.ACTIVATIONS)


def _ref_grad(x, dy, act):
    """d(sum(act(x) * dy))/dx through torch.autograd of the reference, in x's dtype."""
    leaf = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(reference.activation(leaf, act), leaf, dy)
    return g


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
