"""Elementwise activation act(x) by HF name: one read, fp32 math in registers, one write.

Shapes: N elements (any shape, flattened; the op is elementwise, so rows do not matter).

`reference.activation` is x.float() -> act -> .to(dtype): three kernels and two fp32 temporaries
of the input's size (on an 8192-token DeBERTa-v3-base sequence, ~250 MB: most of the forward's
working memory) plus three dispatches of host time per call. `_act_fwd_kernel` does the same math
in one pass. `_act_bwd_kernel` recomputes act'(x) from the saved input (in its own dtype, not an
fp32 copy) and writes dx = dy * act'(x), fp32 math, one rounding. The activation formulas and
their derivatives are glu.py's `_act` (every activation of `reference._ACTS`), shared, not copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from packedenc.kernels import reference
from packedenc.kernels import reference_bwd
from packedenc.kernels.triton._common import check_float, direct_launch
from packedenc.kernels.triton.glu import _act, _code

__all__ = ["activation", "activation_fwd", "activation_bwd", "BLOCK"]

# Elements per program: 8 per thread with 4 warps, i.e. one 16-byte vector load in fp16/bf16.
BLOCK = 1024
_NUM_WARPS = 4


@triton.jit
def _act_fwd_kernel(
    X,  # (N,) contiguous input, any float dtype
    Y,  # (N,) output, X's dtype
    N,  # element count
    ACT: tl.constexpr,  # activation code (glu.ACT_CODES)
    BLOCK: tl.constexpr,
):
    # int64 before the multiply: N may exceed 2**31 (e.g. 32k tokens x a 64k-wide layer).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    y, _ = _act(x, ACT)  # the unused derivative is dead code: the compiler drops it
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _act_bwd_kernel(
    DY,  # (N,) contiguous gradient of the output
    X,  # (N,) contiguous forward input
    DX,  # (N,) out: gradient of the input, X's dtype
    N,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    _, d = _act(x, ACT)
    tl.store(DX + offs, (dy * d).to(DX.dtype.element_ty), mask=mask)


def _fwd(x: Tensor, code: int, block: int = BLOCK, in_place: bool = False) -> Tensor:
    xc = x.contiguous()  # a no-op for a linear layer's output, the usual input
    # in place: each program loads its elements before it stores over them
    y = xc if in_place and xc.data_ptr() == x.data_ptr() else torch.empty_like(xc)
    n = xc.numel()
    if n:
        _act_fwd_kernel[(triton.cdiv(n, block),)](xc, y, n, ACT=code, BLOCK=block, num_warps=_NUM_WARPS)
    return y


def activation_fwd(x: Tensor, act: str, block: int = BLOCK) -> Tensor:
    """Launch the forward: act(x) in x's dtype, same shape (a new, contiguous tensor).

    `block` is for tests only (small blocks give several programs on a tiny input).
    """
    check_float("activation", x)
    return _fwd(x, _code(act), block)


def activation_bwd(dy: Tensor, x: Tensor, act: str, block: int = BLOCK) -> Tensor:
    """Launch the backward: dx = dy * act'(x) in x's dtype, x's shape."""
    check_float("activation", dy, x)
    code = _code(act)
    # Gradients of `.sum()` arrive as stride-0 expanded tensors: contiguous() materialises them.
    xc, dyc = x.contiguous(), dy.contiguous()
    assert dyc.shape == xc.shape, f"activation backward: dy {tuple(dy.shape)} vs x {tuple(x.shape)}"
    dx = torch.empty_like(xc)
    n = xc.numel()
    if n:
        _act_bwd_kernel[(triton.cdiv(n, block),)](dyc, xc, dx, n, ACT=code, BLOCK=block, num_warps=_NUM_WARPS)
    return dx


# ---- registered ops ----------------------------------------------------------------------------


@torch.library.custom_op("packedenc::activation", mutates_args=(), device_types="cpu")
def _activation(x: Tensor, act: str) -> Tensor:
    y = reference.activation(x, act)
    # A custom op's output may not alias its input (the reference returns fp32 x itself for
    # "linear"), and is contiguous like the CUDA kernel's, whatever x's strides.
    return x.clone(memory_format=torch.contiguous_format) if y is x else y.contiguous()


@_activation.register_kernel("cuda")
def _(x, act):
    return activation_fwd(x, act)


@_activation.register_fake
def _(x, act):
    _code(act)  # an unknown activation fails at trace time, not at run time
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("packedenc::activation_bwd", mutates_args=(), device_types="cpu")
def _activation_bwd(dy: Tensor, x: Tensor, act: str) -> Tensor:
    dx = reference_bwd.activation_bwd(dy, x, act)
    return dy.clone(memory_format=torch.contiguous_format) if dx is dy else dx.contiguous()  # "linear"


@_activation_bwd.register_kernel("cuda")
def _(dy, x, act):
    return activation_bwd(dy, x, act)


@_activation_bwd.register_fake
def _(dy, x, act):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    x, act = inputs
    ctx.save_for_backward(x)  # x in its own dtype: half the memory of the reference's fp32 copy
    ctx.act = act


def _backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return torch.ops.packedenc.activation_bwd(dy, x, ctx.act), None


_activation.register_autograd(_backward, setup_context=_setup)


# ---- the Ops-table entry: the reference signature ----------------------------------------------


def activation(x: Tensor, act: str, overwrite_input: bool = False) -> Tensor:
    """Elementwise activation by HF name, fp32 math, one rounding; see `reference.activation`.

    Arguments:
        x: any shape, float16 / bfloat16 / float32 (usually a linear layer's (T, F) output).
        act: an HF activation name (`reference.ACTIVATIONS`).
        overwrite_input: the caller no longer needs x: eager inference then writes act(x) into
            x (when contiguous) and returns it, one (T, F) buffer fewer at the FFN's peak.
    Return:
        act(x) in x's dtype and shape. An unknown `act` raises ConfigError, a non-float `x`
        TypeError. "linear" returns x itself, as the reference does for fp32 (no kernel).
    """
    check_float("activation", x)  # also on the CPU path, whose reference would cast ints silently
    code = _code(act)
    if act == "linear":
        return x
    if direct_launch(x):
        return _fwd(x, code, in_place=overwrite_input)
    return torch.ops.packedenc.activation(x, act)
