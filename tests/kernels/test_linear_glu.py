"""`linear_glu` on the Triton GEMM with the GeGLU gate in its epilogue (eager inference), and the op's
parts (cuBLAS, then the gate kernel), which the table runs for every other call."""

import pytest
import torch

from packedenc.errors import ConfigError, InputError
from packedenc.kernels import choose, reference
from packedenc.kernels.triton import glu as G
from packedenc.kernels.triton import linear_glu as LG
from tests.kernels._assert import assert_close_to_ref


def _operands(T, D, F, dtype, bias, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, D, device=device, generator=g).to(dtype)
    w = (torch.randn(2 * F, D, device=device, generator=g) / D**0.5).to(dtype)
    b = (torch.randn(2 * F, device=device, generator=g) / 4).to(dtype) if bias else None
    return x, w, b


def _f32(*ts):
    return [None if t is None else t.float() for t in ts]


def test_the_parts_are_the_reference_and_end_every_chain():
    x, w, b = _operands(5, 16, 8, torch.float32, True)
    parts = reference.compose_linear_glu(reference.linear, reference.glu)
    assert torch.equal(parts(x, w, b, "silu"), reference.linear_glu(x, w, b, "silu"))
    with pytest.raises(ConfigError, match="mish"):
        parts(x, w, b, "mish")
    every = {"triton", "flash"}.__contains__
    assert choose("linear_glu", "reference", "cuda", every) == "linear+glu"
    assert choose("linear_glu", "triton", "cuda", every) == "triton>linear+glu"  # the rest: its parts
    assert choose("linear_glu", "auto", "cpu") == "linear+glu"


# (T, D, F, tile): one tile with masked rows; several tiles with masked rows, columns and a K tail
_SHAPES = [(9, 32, 24, LG.TILE), (37, 40, 40, (16, 16, 16, 4, 1))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", _SHAPES)
def test_fused_gemm_matches_the_reference(dtype, bias, shape):
    T, D, F, tile = shape
    x, w, b = _operands(T, D, F, dtype, bias)
    for act in ("gelu", "silu", "gelu_pytorch_tanh"):
        y = LG.linear_glu_fwd(x, w, b, G._code(act), tile=tile)
        assert y.shape == (T, F) and y.is_contiguous()
        want = reference.linear_glu(*_f32(x, w, b), act)
        if dtype == torch.float32:
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        else:  # u rounded to fp16 before the gate, as the parts round it
            assert_close_to_ref(y, want, reference.linear_glu(x, w, b, act), atol=1e-3, what=f"linear_glu {act}")


def test_fused_gemm_rows_stay_in_their_sequence_of_rows():
    """A row's output depends on its own input row only: rows past T are never read into it."""
    x, w, b = _operands(21, 32, 24, torch.float32, True)
    y = LG.linear_glu(x, w, b)
    x2 = x.clone()
    x2[7] *= 3
    y2 = LG.linear_glu(x2, w, b)
    assert torch.equal(y2[:7], y[:7]) and torch.equal(y2[8:], y[8:]) and not torch.equal(y2[7], y[7])
    assert LG.linear_glu(x[:0], w, b).shape == (0, 24)
    assert torch.equal(LG.covered_linear_glu(x, w, b), y)  # the table's entry: the same kernel, checks skipped


def test_bad_input_is_a_clear_error():
    x, w, b = _operands(5, 16, 8, torch.float32, True)
    with pytest.raises(ConfigError, match="mish"):
        LG.linear_glu(x, w, b, "mish")
    with pytest.raises(InputError, match="gate rows"):
        LG.linear_glu(x, w[:-1], None)
    with pytest.raises(InputError, match="gate rows"):
        LG.linear_glu(x[:, :8], w, b)
    with pytest.raises(InputError, match="bias"):
        LG.linear_glu(x, w, b[:-2])
    with pytest.raises(InputError, match="share a dtype"):
        LG.linear_glu(x, w.half(), None)
    with pytest.raises(InputError, match="contiguous"):
        LG.linear_glu(x.t().contiguous().t(), w, b)
    with pytest.raises(InputError, match="float16, bfloat16 or float32"):
        LG.linear_glu(x.double(), w.double(), None)
    with pytest.raises(InputError, match="forward only"):
        LG.linear_glu(x, w.clone().requires_grad_(), b)


def test_covers_only_eager_cuda_inference_on_half_precision():
    x, w, b = _operands(5, 16, 8, torch.float16, False)
    assert not LG.covers_linear_glu(x, w, b)  # CPU tensors: the parts
    assert not LG.covers_linear_glu(x.float(), w.float(), b)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4099, 768, 1152, True), (1000, 760, 1000, False)])
def test_gpu_fused_in_inference_parts_with_gradients_two_x_rule(shape):
    from packedenc.kernels import get_ops

    T, D, F, bias = shape  # ModernBERT-base's Wi; then K and F off the tiles
    ops = get_ops("triton", "cuda")
    assert dict(ops.chosen)["linear_glu"] == "triton>linear+glu"
    x, w, b = _operands(T, D, F, torch.bfloat16, bias, device="cuda")
    want = reference.linear_glu(*_f32(x, w, b), "gelu")
    plain = reference.linear_glu(x, w, b, "gelu")
    with torch.inference_mode():
        assert LG.covers_linear_glu(x, w, b)
        y = ops.linear_glu(x, w, b, "gelu")
    assert y.stride(0) == F  # the fused GEMM's own (T, F) output (the parts give a view of u, row stride 2F)
    assert_close_to_ref(y, want, plain, atol=1e-3, what="fused linear_glu")
    assert torch.equal(y, LG.linear_glu(x, w, b, "gelu"))  # deterministic
    # with gradients: the parts (cuBLAS, then the gate's op with its backward)
    leaves = [None if t is None else t.clone().requires_grad_() for t in (x, w, b)]
    assert not LG.covers_linear_glu(*leaves)
    got = ops.linear_glu(*leaves, "gelu")
    d = torch.randn_like(got)
    f32 = [None if t is None else t.float().requires_grad_() for t in (x, w, b)]
    low = [None if t is None else t.clone().requires_grad_() for t in (x, w, b)]
    use = [i for i, t in enumerate(leaves) if t is not None]
    g_got = torch.autograd.grad(got, [leaves[i] for i in use], d)
    g_want = torch.autograd.grad(reference.linear_glu(*f32, "gelu"), [f32[i] for i in use], d.float())
    g_low = torch.autograd.grad(reference.linear_glu(*low, "gelu"), [low[i] for i in use], d)
    for i, a, e, c in zip(use, g_got, g_want, g_low):
        assert_close_to_ref(a, e, c, atol=1e-3, what=f"linear_glu grad {i}")
