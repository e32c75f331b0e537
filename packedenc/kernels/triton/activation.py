"""Elementwise activation act(x) or act(x + bias) by HF name: one read, fp32 math in registers, one write.

Shapes: N elements (any shape, flattened; the op is elementwise, so rows do not matter); with a
bias, T rows of F (the last dim), P row ranges of the bias backward.

`reference.activation` is x.float() -> act -> .to(dtype): three kernels and two fp32 temporaries
of the input's size (on an 8192-token DeBERTa-v3-base sequence, ~250 MB: most of the forward's
working memory) plus three dispatches of host time per call. `_act_fwd_kernel` does the same math
in one pass. `_act_bwd_kernel` recomputes act'(x) from the saved input (in its own dtype, not an
fp32 copy) and writes dx = dy * act'(x), fp32 math, one rounding. The activation formulas and
their derivatives are glu.py's `_act` (every activation of `reference._ACTS`), shared, not copied.

With a bias (the FFN's first linear layer runs its GEMM without one) the kernels take (BLOCK_T,
BLOCK_F) tiles so each column knows its bias. `_bias_act_bwd_kernel` then also sums the fp32 dx
over its rows: P programs per column block each own a fixed range of row tiles and write one fp32
partial row, and `colsum` of the (P, F) partials gives dbias. Autograd's `db = dy.sum(0)` of
a biased linear layer, a second full (T, F) read, is gone; the partition depends only on T, so the
result is deterministic (no atomics). Without a bias the flat kernels run, unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from packedenc.kernels import reference
from packedenc.kernels.reference import backward as reference_bwd
from packedenc.kernels.triton._common import (
    cdiv, check_float, direct_launch, eager_autograd, eager_cuda, launch, launch_or_op, next_pow2, rows,
)
from packedenc.kernels.triton.colsum import colsum
from packedenc.kernels.triton.glu import _act, _code

__all__ = ["activation", "activation_fwd", "activation_bwd", "bias_activation_fwd", "bias_activation_bwd", "BLOCK"]

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


@triton.jit
def _bias_act_fwd_kernel(
    X,  # (T, F) input rows, last dim contiguous
    B,  # (F,) bias
    Y,  # (T, F) out, X's dtype (may be X itself: each program loads its tile before it stores)
    T, F,
    stride_x, stride_y,  # row strides (elements)
    ACT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    col = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    cmask = col < F
    mask = (row < T)[:, None] & cmask[None, :]
    x = tl.load(X + row[:, None] * stride_x + col[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + col, mask=cmask, other=0.0).to(tl.float32)
    y, _ = _act(x + b[None, :], ACT)  # the sum stays fp32: one rounding, of the result
    tl.store(Y + row[:, None] * stride_y + col[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_act_bwd_kernel(
    DY,  # (T, F) gradient of the output
    X,  # (T, F) forward input (without the bias)
    B,  # (F,) bias
    DX,  # (T, F) out: dy * act'(x + b), X's dtype
    PART,  # (P, F) fp32 out: this program's column sums of the fp32 dx
    T, F,
    tiles_per_prog,  # program (p, c) owns row tiles [p * tiles_per_prog, (p + 1) * tiles_per_prog)
    stride_dy, stride_x, stride_dx,
    ACT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    pid = tl.program_id(0)
    col = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    cmask = col < F
    b = tl.load(B + col, mask=cmask, other=0.0).to(tl.float32)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_F], dtype=tl.float32)
    first = pid.to(tl.int64) * tiles_per_prog * BLOCK_T
    for i in range(0, tiles_per_prog):
        row = first + i * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        mask = (row < T)[:, None] & cmask[None, :]
        x = tl.load(X + row[:, None] * stride_x + col[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row[:, None] * stride_dy + col[None, :], mask=mask, other=0.0).to(tl.float32)
        _, d = _act(x + b, ACT)
        dx = dy * d  # 0 on masked elements (dy = 0 there, act' finite)
        tl.store(DX + row[:, None] * stride_dx + col[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        acc += dx
    tl.store(PART + pid.to(tl.int64) * F + col, tl.sum(acc, axis=0), mask=cmask)


def _bias_tile(F: int) -> tuple[int, int]:
    # (BLOCK_T, BLOCK_F): 2048 elements for 4 warps, 16 a thread (two 16-byte loads in bf16); a
    # 256-wide row piece is 512 contiguous bytes. F = 2048 (the graph transformer's FFN): 8 column blocks.
    block_f = min(256, next_pow2(F))
    return max(1, 2048 // block_f), block_f


# Row ranges of the bias backward: about this many per column block. At T = 108k, F = 2048
# (8-row tiles, 8 column blocks): ~965 ranges of 14 tiles, 7.7k programs (a few waves on an H200)
# and 7.9 MB of fp32 partials, whose sum reads 0.6% of the kernel's 1.3 GB.
BWD_ROW_PROGRAMS = 1024


def bias_activation_fwd(x: Tensor, bias: Tensor, act: str, in_place: bool = False,
                        tile: tuple[int, int] | None = None) -> Tensor:
    """Launch the forward act(x + bias): x's dtype and shape. `in_place` writes over x when it is
    contiguous; `tile` (BLOCK_T, BLOCK_F) is for tests (several programs on a tiny input)."""
    check_float("activation", x)
    code = _code(act)
    reference.check_bias("activation", bias, x)
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y2 = x2 if in_place and x2.data_ptr() == x.data_ptr() else torch.empty_like(x2)
    T, F = x2.shape
    if x2.numel():
        BLOCK_T, BLOCK_F = tile or _bias_tile(F)
        launch(_bias_act_fwd_kernel, (cdiv(T, BLOCK_T), cdiv(F, BLOCK_F)),
            x2, bias.contiguous(), y2, T, F, x2.stride(0), y2.stride(0),
            ACT=code, BLOCK_T=BLOCK_T, BLOCK_F=BLOCK_F, num_warps=_NUM_WARPS)
    return y2.view(x.shape)


def bias_activation_bwd(dy: Tensor, x: Tensor, bias: Tensor, act: str, tile: tuple[int, int] | None = None,
                        programs: int | None = None) -> tuple[Tensor, Tensor]:
    """Launch the backward: (dx = dy * act'(x + bias) in x's dtype and shape, dbias in bias's dtype).

    `tile` and `programs` (row ranges, default BWD_ROW_PROGRAMS) are for tests."""
    check_float("activation", dy, x)
    code = _code(act)
    reference.check_bias("activation", bias, x)
    assert dy.shape == x.shape, f"activation backward: dy {tuple(dy.shape)} vs x {tuple(x.shape)}"
    dy2, x2 = rows(dy), rows(x)  # rows(): materialises stride-0 gradients of `.sum()`
    T, F = x2.shape
    dx = torch.empty((T, F), dtype=x.dtype, device=x.device)
    BLOCK_T, BLOCK_F = tile or _bias_tile(F)
    n_tiles = cdiv(T, BLOCK_T)
    tiles_per_prog = max(1, cdiv(n_tiles, programs or BWD_ROW_PROGRAMS))  # fixed by T alone
    P = max(1, cdiv(n_tiles, tiles_per_prog))
    # every program writes its partial row, so no fill is needed (zeros when there is no launch)
    part = (torch.empty if T and F else torch.zeros)((P, F), dtype=torch.float32, device=x.device)
    if T and F:
        launch(_bias_act_bwd_kernel, (P, cdiv(F, BLOCK_F)),
            dy2, x2, bias.contiguous(), dx, part, T, F, tiles_per_prog,
            dy2.stride(0), x2.stride(0), dx.stride(0),
            ACT=code, BLOCK_T=BLOCK_T, BLOCK_F=BLOCK_F, num_warps=_NUM_WARPS)
    return dx.view(x.shape), colsum(part).to(bias.dtype)


def _fwd(x: Tensor, code: int, block: int = BLOCK, in_place: bool = False) -> Tensor:
    xc = x.contiguous()  # a no-op for a linear layer's output, the usual input
    # in place: each program loads its elements before it stores over them
    y = xc if in_place and xc.data_ptr() == x.data_ptr() else torch.empty_like(xc)
    n = xc.numel()
    if n:
        launch(_act_fwd_kernel, (cdiv(n, block),), xc, y, n, ACT=code, BLOCK=block, num_warps=_NUM_WARPS)
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
        launch(_act_bwd_kernel, (cdiv(n, block),), dyc, xc, dx, n, ACT=code, BLOCK=block, num_warps=_NUM_WARPS)
    return dx


# ---- registered ops ----------------------------------------------------------------------------


def _activation_cuda(x, act):
    return activation_fwd(x, act)


@triton_op("packedenc::activation", mutates_args=())
def _activation(x: Tensor, act: str) -> Tensor:
    if x.is_cuda:
        return _activation_cuda(x, act)
    y = reference.activation(x, act)
    # A custom op's output may not alias its input (the reference returns fp32 x itself for
    # "linear"), and is contiguous like the CUDA kernel's, whatever x's strides.
    return x.clone(memory_format=torch.contiguous_format) if y is x else y.contiguous()


def _activation_bwd_cuda(dy, x, act):
    return activation_bwd(dy, x, act)


@triton_op("packedenc::activation_bwd", mutates_args=())
def _activation_bwd(dy: Tensor, x: Tensor, act: str) -> Tensor:
    if dy.is_cuda:
        return _activation_bwd_cuda(dy, x, act)
    dx = reference_bwd.activation_bwd(dy, x, act)
    return dy.clone(memory_format=torch.contiguous_format) if dx is dy else dx.contiguous()  # "linear"


def _setup(ctx, inputs, output):
    x, act = inputs
    ctx.save_for_backward(x)  # x in its own dtype: half the memory of the reference's fp32 copy
    ctx.act = act


def _backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return launch_or_op(_activation_bwd_cuda, torch.ops.packedenc.activation_bwd, dy, x, ctx.act), None


_activation.register_autograd(_backward, setup_context=_setup)
_activation_eager = eager_autograd(_activation_cuda, _setup, _backward)


def _bias_activation_cuda(x, bias, act):
    return bias_activation_fwd(x, bias, act)


@triton_op("packedenc::bias_activation", mutates_args=())
def _bias_activation(x: Tensor, bias: Tensor, act: str) -> Tensor:
    if x.is_cuda:
        return _bias_activation_cuda(x, bias, act)
    return reference.activation(x, act, bias=bias).contiguous()  # a new tensor: x + bias never aliases x


def _bias_activation_bwd_cuda(dy, x, bias, act):
    return bias_activation_bwd(dy, x, bias, act)


@triton_op("packedenc::bias_activation_bwd", mutates_args=())
def _bias_activation_bwd(dy: Tensor, x: Tensor, bias: Tensor, act: str) -> tuple[Tensor, Tensor]:
    if dy.is_cuda:
        return _bias_activation_bwd_cuda(dy, x, bias, act)
    dx, db = reference_bwd.bias_activation_bwd(dy, x, bias, act)
    return dy.clone(memory_format=torch.contiguous_format) if dx is dy else dx.contiguous(), db  # "linear"


def _bias_setup(ctx, inputs, output):
    x, bias, act = inputs
    ctx.save_for_backward(x, bias)  # x without the bias: x + bias is recomputed in registers
    ctx.act = act


def _bias_backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dx, db = launch_or_op(_bias_activation_bwd_cuda, torch.ops.packedenc.bias_activation_bwd, dy, x, bias, ctx.act)
    return dx, db, None


_bias_activation.register_autograd(_bias_backward, setup_context=_bias_setup)
_bias_activation_eager = eager_autograd(_bias_activation_cuda, _bias_setup, _bias_backward)


# ---- the Ops-table entry: the reference signature ----------------------------------------------


def activation(x: Tensor, act: str, overwrite_input: bool = False, bias: Tensor | None = None) -> Tensor:
    """Elementwise activation by HF name, fp32 math, one rounding; see `reference.activation`.

    Arguments:
        x: any shape, float16 / bfloat16 / float32 (usually a linear layer's (T, F) output).
        act: an HF activation name (`reference.ACTIVATIONS`).
        overwrite_input: the caller no longer needs x: eager inference then writes act(x) into
            x (when contiguous) and returns it, one (T, F) buffer fewer at the FFN's peak.
        bias: (F,) in x's dtype on x's device, or None: act(x + bias), x + bias in fp32. The
            backward then returns dbias from the same kernel as dx (no separate (T, F) sum).
    Return:
        act(x) (or act(x + bias)) in x's dtype and shape. An unknown `act` raises ConfigError, a
        non-float `x` TypeError, a bias of the wrong shape, dtype or device InputError. "linear"
        without a bias returns x itself, as the reference does for fp32 (no kernel).
    """
    check_float("activation", x)  # also on the CPU path, whose reference would cast ints silently
    code = _code(act)
    if bias is not None:
        reference.check_bias("activation", bias, x)
        if direct_launch(x, bias):
            return bias_activation_fwd(x, bias, act, in_place=overwrite_input)
        if eager_cuda(x, bias):
            return _bias_activation_eager(x, bias, act)
        return torch.ops.packedenc.bias_activation(x, bias, act)
    if act == "linear":
        return x
    if direct_launch(x):
        return _fwd(x, code, in_place=overwrite_input)
    if eager_cuda(x):
        return _activation_eager(x, act)
    return torch.ops.packedenc.activation(x, act)
