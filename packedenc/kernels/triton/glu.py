"""Gated linear unit act(u[:, :F]) * u[:, F:] (ModernBERT GeGLU: exact-erf GELU on the FIRST half).

Shapes: T packed tokens, F mlp width (u is (T, 2F)).

`_glu_fwd_kernel`: a program takes a (BLOCK_T, BLOCK_F) tile of the output, loads the matching
input and gate tiles, computes in fp32 and rounds once (HF eager rounds act(.) first: <= 1 ulp).
`_glu_bwd_kernel` recomputes act and act' and writes both halves of du. Every activation of
`reference._ACTS` is supported; the name is mapped to a compile-time code.
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

__all__ = ["glu", "glu_fwd", "glu_bwd", "ACT_CODES"]

# HF activation name -> code in `_act`. gelu_new / gelu_pytorch_tanh / gelu_fast are one formula.
ACT_CODES = {
    "gelu": 0, "gelu_python": 0,
    "gelu_new": 1, "gelu_pytorch_tanh": 1, "gelu_fast": 1,
    "quick_gelu": 2,
    "silu": 3, "swish": 3,
    "relu": 4,
    "tanh": 5,
    "sigmoid": 6,
    "linear": 7,
}
assert set(ACT_CODES) == set(reference.ACTIVATIONS), "glu: every reference activation needs a code"

_SQRT1_2 = tl.constexpr(0.7071067811865476)
_SQRT2_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _tanh(x):
    # tanh from exp (tl.math has no tanh that the interpreter runs); abs error ~1e-7.
    e = tl.exp(-2.0 * tl.abs(x))
    r = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -r, r)


@triton.jit
def _act(x, ACT: tl.constexpr):
    """(act(x), act'(x)) in fp32."""
    if ACT == 0:  # exact GELU: x * Phi(x)
        cdf = 0.5 * (1.0 + tl.math.erf(x * _SQRT1_2))
        return x * cdf, cdf + x * tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
    elif ACT == 1:  # tanh GELU
        inner = _SQRT2_PI * (x + 0.044715 * x * x * x)
        th = _tanh(inner)
        d = 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * _SQRT2_PI * (1.0 + 3.0 * 0.044715 * x * x)
        return 0.5 * x * (1.0 + th), d
    elif ACT == 2:  # quick GELU: x * sigmoid(1.702 x)
        sg = tl.sigmoid(1.702 * x)
        return x * sg, sg + 1.702 * x * sg * (1.0 - sg)
    elif ACT == 3:  # SiLU
        sg = tl.sigmoid(x)
        return x * sg, sg * (1.0 + x * (1.0 - sg))
    elif ACT == 4:  # ReLU (gradient 0 at 0, like torch)
        return tl.maximum(x, 0.0), tl.where(x > 0, 1.0, 0.0)
    elif ACT == 5:
        th = _tanh(x)
        return th, 1.0 - th * th
    elif ACT == 6:
        sg = tl.sigmoid(x)
        return sg, sg * (1.0 - sg)
    else:
        return x, tl.full(x.shape, 1.0, tl.float32)


@triton.jit
def _glu_fwd_kernel(
    U,  # (T, 2F): input half | gate half
    OUT,  # (T, F)
    T, F,
    stride_u, stride_o,  # row strides (elements)
    ACT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    col = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (row < T)[:, None] & (col < F)[None, :]
    u = U + row[:, None] * stride_u + col[None, :]
    a = tl.load(u, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(u + F, mask=mask, other=0.0).to(tl.float32)
    y, _ = _act(a, ACT)
    tl.store(OUT + row[:, None] * stride_o + col[None, :], (y * g).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(
    DOUT,  # (T, F) gradient of the output
    U,  # (T, 2F) forward input
    DU,  # (T, 2F) out: [d input half | d gate half]
    T, F,
    stride_d, stride_u, stride_du,
    ACT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    col = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (row < T)[:, None] & (col < F)[None, :]
    u = U + row[:, None] * stride_u + col[None, :]
    a = tl.load(u, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(u + F, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(DOUT + row[:, None] * stride_d + col[None, :], mask=mask, other=0.0).to(tl.float32)
    y, dy = _act(a, ACT)
    du = DU + row[:, None] * stride_du + col[None, :]
    tl.store(du, (d * g * dy).to(DU.dtype.element_ty), mask=mask)
    tl.store(du + F, (d * y).to(DU.dtype.element_ty), mask=mask)


def _tile(T: int, F: int) -> tuple[tuple[int, int], int, int, int]:
    # 128 x 16 was the fastest of 5 tiles at T=32k, F=1152 on an H200 (benchmarks/results/history/NOTES-diary.md);
    # 1152 = 9 x 128, so no masked columns either.
    BLOCK_F = min(128, next_pow2(F))
    BLOCK_T = max(1, min(64, 2048 // BLOCK_F))
    return (cdiv(T, BLOCK_T), cdiv(F, BLOCK_F)), BLOCK_T, BLOCK_F, 4


def _code(act: str) -> int:
    return ACT_CODES[reference.check_activation(act)]


def glu_fwd(u_T2F: Tensor, act: str = "gelu", in_place: bool = False) -> Tensor:
    """Launch the forward: (…, 2F) -> (…, F); `in_place` writes into u's first half (a strided view)."""
    check_float("glu", u_T2F)
    code = _code(act)
    u = rows(u_T2F)
    T, F2 = u.shape
    assert F2 % 2 == 0, "glu: the last dim must be even (input half | gate half)"
    F = F2 // 2
    if in_place and u.data_ptr() == u_T2F.data_ptr() and u_T2F.dim() == 2:
        out = u[:, :F]  # each program loads its u elements before it stores over them
    else:
        out = torch.empty((T, F), dtype=u.dtype, device=u.device)
    if T:
        grid, BLOCK_T, BLOCK_F, num_warps = _tile(T, F)
        launch(_glu_fwd_kernel, grid, u, out, T, F, u.stride(0), out.stride(0),
                              ACT=code, BLOCK_T=BLOCK_T, BLOCK_F=BLOCK_F, num_warps=num_warps)
    return out if out.dim() == u_T2F.dim() else out.view(*u_T2F.shape[:-1], F)


def glu_bwd(dout_TF: Tensor, u_T2F: Tensor, act: str = "gelu") -> Tensor:
    """Launch the backward: du (…, 2F) in u's dtype."""
    code = _code(act)
    u, d = rows(u_T2F), rows(dout_TF)
    T, F2 = u.shape
    F = F2 // 2
    du = torch.empty((T, F2), dtype=u.dtype, device=u.device)
    if T:
        grid, BLOCK_T, BLOCK_F, num_warps = _tile(T, F)
        launch(_glu_bwd_kernel, grid, d, u, du, T, F, d.stride(0), u.stride(0), du.stride(0),
                              ACT=code, BLOCK_T=BLOCK_T, BLOCK_F=BLOCK_F, num_warps=num_warps)
    return du.view(u_T2F.shape)


def _glu_cuda(u, act="gelu"):
    return glu_fwd(u, act)


@triton_op("packedenc::glu", mutates_args=())
def _glu(u: Tensor, act: str = "gelu") -> Tensor:
    if u.is_cuda:
        return _glu_cuda(u, act)
    return reference.glu(u, act)


def _glu_bwd_cuda(dout, u, act):
    return glu_bwd(dout, u, act)


@triton_op("packedenc::glu_bwd", mutates_args=())
def _glu_bwd(dout: Tensor, u: Tensor, act: str) -> Tensor:
    if dout.is_cuda:
        return _glu_bwd_cuda(dout, u, act)
    return reference_bwd.glu_bwd(dout, u, act)


def _setup(ctx, inputs, output):
    u, act = inputs
    ctx.save_for_backward(u)
    ctx.act = act


def _backward(ctx, dout):
    (u,) = ctx.saved_tensors
    return launch_or_op(_glu_bwd_cuda, torch.ops.packedenc.glu_bwd, dout, u, ctx.act), None


_glu.register_autograd(_backward, setup_context=_setup)
_glu_eager = eager_autograd(_glu_cuda, _setup, _backward)


def glu(u_T2F: Tensor, act: str = "gelu", overwrite_input: bool = False) -> Tensor:
    """act(u[:, :F]) * u[:, F:], fp32 math, one rounding; see `reference.glu`.

    Arguments:
        u_T2F: (T, 2F) the Wi output, input half then gate half. act: an HF activation name.
        overwrite_input: the caller no longer needs u: eager inference then writes the result
            into u's first half and returns that (T, F) view (row stride 2F), one buffer fewer.
    Return:
        (T, F) in u's dtype. An unknown `act` raises ConfigError.
    """
    if direct_launch(u_T2F):
        return glu_fwd(u_T2F, act, in_place=overwrite_input)
    _code(act)
    if eager_cuda(u_T2F):
        return _glu_eager(u_T2F, act)
    return torch.ops.packedenc.glu(u_T2F, act)
