"""LayerNorm, residual add + LayerNorm, and embedding gather + LayerNorm: one Triton kernel each way.

Shapes: T packed tokens, D hidden, V vocab, P backward programs, k parameter gradients summed at once.

The kernels and launchers are in `layer_norm_kernels.py`. Forward `_ln_fwd_kernel`: a program normalises BLOCK_T whole rows held in registers; fp32
statistics with the centred (two-pass) variance, one rounding. With a residual it first rounds
x + residual to the activation dtype, exactly as two eager ops would, stores that sum (the new
residual) and normalises it; an `x_bias` (the bias of the GEMM that produced x, which then runs
without it) is added to x in fp32 first, inside the same rounding. With ids it gathers the rows
from the embedding table instead.
Backward `_ln_bwd_kernel`: P <= BWD_PROGRAMS programs each own a fixed contiguous range of row tiles,
recompute the statistics, write dx and one fp32 partial row each of dweight, dbias and (with an
x_bias) d x_bias = column sums of the fp32 dx, into one (P, k, D) buffer: one torch sum and one
cast then give all k. The partition depends only on T, so the backward is deterministic (no atomics).

Each op is a `torch.library.triton_op` whose CPU branch is `kernels/reference/` and whose CUDA
branch launches the kernel; the backward is itself an op (CPU: autograd of the reference), so
`torch.compile(fullgraph=True)` traces forward and backward into the Triton kernels themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import triton_op

from packedenc.kernels import reference
from packedenc.kernels.reference import backward as reference_bwd
from packedenc.kernels.triton._common import direct_launch, eager_autograd, eager_cuda, launch_or_op
from packedenc.kernels.triton.layer_norm_kernels import ln_bwd, ln_fwd

__all__ = ["layer_norm", "add_layer_norm", "embed_layer_norm"]


# ---- registered ops ----------------------------------------------------------------------------
# Each op's CUDA branch launches the kernel through `_common.launch`, which a trace records with
# `wrap_triton`; the function is also the op's fake (shapes from the same code, no second copy).


def _layer_norm_cuda(x, weight, bias, eps):
    return ln_fwd(x, weight, bias, eps)[0]


@triton_op("packedenc::layer_norm", mutates_args=())
def _layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    if x.is_cuda:
        return _layer_norm_cuda(x, weight, bias, eps)
    return reference.layer_norm(x, weight, bias, eps)


def _add_layer_norm_cuda(x, residual, weight, bias, eps, x_bias=None):
    return ln_fwd(x, weight, bias, eps, residual=residual, x_bias=x_bias)


@triton_op("packedenc::add_layer_norm", mutates_args=())
def _add_layer_norm(
    x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor | None, eps: float, x_bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    if x.is_cuda:
        return _add_layer_norm_cuda(x, residual, weight, bias, eps, x_bias)
    return reference.add_layer_norm(x, residual, weight, bias, eps, x_bias)


def _embed_layer_norm_cuda(ids, table, weight, bias, eps):
    return ln_fwd(table, weight, bias, eps, ids=ids)[0].view(*ids.shape, table.shape[-1])


@triton_op("packedenc::embed_layer_norm", mutates_args=())
def _embed_layer_norm(ids: Tensor, table: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    if ids.is_cuda:
        return _embed_layer_norm_cuda(ids, table, weight, bias, eps)
    return reference.embed_layer_norm(ids, table, weight, bias, eps)


def _layer_norm_bwd_cuda(dy, x, ids, dsum, weight, eps, need_db=True, need_dxb=False):
    return ln_bwd(dy, x, weight, eps, dsum=dsum, ids=ids, need_db=need_db, need_dxb=need_dxb)


# The backward op: dx of the LayerNorm input rows (gathered from `x` through `ids` when given),
# plus `dsum` (gradient arriving at the LayerNorm input from elsewhere), and the (k, D) fp32 sums:
# dweight, then dbias if `need_db` (bias-free norms skip that reduction), then d x_bias (column
# sums of dx) if `need_dxb`. One stacked output: the autograd functions cast it once and unbind.
@triton_op("packedenc::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd(
    dy: Tensor, x: Tensor, ids: Tensor | None, dsum: Tensor | None, weight: Tensor, eps: float,
    need_db: bool = True, need_dxb: bool = False,
) -> tuple[Tensor, Tensor]:
    if dy.is_cuda:
        return _layer_norm_bwd_cuda(dy, x, ids, dsum, weight, eps, need_db, need_dxb)
    rows_ = F.embedding(ids, x) if ids is not None else x
    # an fp32 weight makes the reference return its sums unrounded, as the kernel's partials are
    dx, dw, db, dxb = reference_bwd.layer_norm_bwd(dy, rows_, weight.float(), eps, dsum, need_dxb=True)
    sums = [dw] + [db] * need_db + [dxb] * need_dxb
    return dx.reshape(-1, x.shape[-1]), torch.stack(sums)


def _split(sums: Tensor, weight: Tensor, has_bias: bool, xb_dtype: torch.dtype | None = None):
    """(dweight, dbias or None, d x_bias or None) from the (k, D) fp32 sums: one cast when the
    x_bias has the weight's dtype (the usual case), else d x_bias is rounded from fp32 on its own."""
    if xb_dtype is None or xb_dtype == weight.dtype:
        g = sums.to(weight.dtype).unbind(0)
    else:
        g = (*sums[:-1].to(weight.dtype).unbind(0), sums[-1].to(xb_dtype))
    return g[0], g[1] if has_bias else None, g[-1] if xb_dtype is not None else None


def _ln_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.has_bias = eps, bias is not None


def _ln_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, sums = launch_or_op(_layer_norm_bwd_cuda, torch.ops.packedenc.layer_norm_bwd, dy, x, None, None, weight,
                            ctx.eps, ctx.has_bias)
    dw, db, _ = _split(sums, weight, ctx.has_bias)
    return dx.view_as(x), dw, db, None


def _add_ln_setup(ctx, inputs, output):
    x, residual, weight, bias, eps, x_bias = inputs
    ctx.save_for_backward(output[1], weight)  # the rounded sum is the LayerNorm input
    ctx.eps, ctx.has_bias = eps, bias is not None
    ctx.dtypes = (x.dtype, residual.dtype)
    ctx.xb_dtype = None if x_bias is None else x_bias.dtype
    # An unused output (the final norm's sum) gets None, not a zero-filled (T, D) gradient.
    ctx.set_materialize_grads(False)


def _add_ln_backward(ctx, dy, dsum):
    s, weight = ctx.saved_tensors
    if dy is None and dsum is None:
        return None, None, None, None, None, None
    if dy is None:  # only the sum is used: the LayerNorm contributes nothing
        ds, dw, db, dxb = dsum, None, None, None
        if ctx.xb_dtype is not None:
            dxb = dsum.reshape(-1, s.shape[-1]).sum(0, dtype=torch.float32).to(ctx.xb_dtype)
    else:
        ds, sums = launch_or_op(_layer_norm_bwd_cuda, torch.ops.packedenc.layer_norm_bwd, dy, s, None, dsum, weight, ctx.eps, ctx.has_bias,
                                                      ctx.xb_dtype is not None)
        ds = ds.view_as(s)
        dw, db, dxb = _split(sums, weight, ctx.has_bias, ctx.xb_dtype)
    # a dtype compare, not a no-op `.to` per input: two calls per layer of an eager training step
    dx, dr = (ds if ds.dtype == dt else ds.to(dt) for dt in ctx.dtypes)
    return dx, dr, dw, db, None, dxb


def _embed_ln_setup(ctx, inputs, output):
    ids, table, weight, bias, eps = inputs
    ctx.save_for_backward(ids, table, weight)
    ctx.eps, ctx.has_bias = eps, bias is not None


def _embed_ln_backward(ctx, dy):
    ids, table, weight = ctx.saved_tensors
    dx, sums = launch_or_op(_layer_norm_bwd_cuda, torch.ops.packedenc.layer_norm_bwd, dy, table, ids.reshape(-1), None,
                            weight, ctx.eps, ctx.has_bias)
    dw, db, _ = _split(sums, weight, ctx.has_bias)
    # embedding_dense_backward is F.embedding's own backward (sorted segment sums on CUDA).
    dtable = torch.ops.aten.embedding_dense_backward(dx, ids.reshape(-1), table.shape[0], -1, False)
    return None, dtable, dw, db, None


_layer_norm.register_autograd(_ln_backward, setup_context=_ln_setup)
_add_layer_norm.register_autograd(_add_ln_backward, setup_context=_add_ln_setup)
_embed_layer_norm.register_autograd(_embed_ln_backward, setup_context=_embed_ln_setup)
_layer_norm_eager = eager_autograd(_layer_norm_cuda, _ln_setup, _ln_backward)
_add_layer_norm_eager = eager_autograd(_add_layer_norm_cuda, _add_ln_setup, _add_ln_backward)
_embed_layer_norm_eager = eager_autograd(_embed_layer_norm_cuda, _embed_ln_setup, _embed_ln_backward)


# ---- the Ops-table entries: reference signatures ----------------------------------------------


def layer_norm(x_TD: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """LayerNorm over the last dim: fp32 statistics, one rounding (see `reference.layer_norm`)."""
    if direct_launch(x_TD, weight, bias):
        return ln_fwd(x_TD, weight, bias, eps)[0]
    if eager_cuda(x_TD, weight, bias):
        return _layer_norm_eager(x_TD, weight, bias, eps)
    return torch.ops.packedenc.layer_norm(x_TD, weight, bias, eps)


def add_layer_norm(
    x_TD: Tensor, residual_TD: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
    x_bias: Tensor | None = None, keep_sum: bool = True, overwrite_input: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(LayerNorm(x + residual), x + residual), the sum rounded before the statistics.

    `x_bias` (D,) in x's dtype, or None: the sum is x + x_bias + residual (see
    `reference.add_layer_norm`), and the backward returns its gradient from the LayerNorm
    backward kernel. A bias of the wrong shape, dtype or device raises InputError. `keep_sum`
    False (post-LN layers drop the sum) returns (y, None), and eager inference skips writing it.
    `overwrite_input`: the caller no longer needs x and residual; eager inference then writes y
    into x and the sum into residual (`ln_fwd`'s `in_place`), allocating nothing."""
    if x_bias is not None:
        reference.check_bias("add_layer_norm", x_bias, x_TD, "x_bias")
    if direct_launch(x_TD, residual_TD, weight, bias, x_bias):
        return ln_fwd(x_TD, weight, bias, eps, residual=residual_TD, x_bias=x_bias, keep_sum=keep_sum,
                      in_place=overwrite_input)
    if eager_cuda(x_TD, residual_TD, weight, bias, x_bias):
        y, s = _add_layer_norm_eager(x_TD, residual_TD, weight, bias, eps, x_bias)
    else:
        y, s = torch.ops.packedenc.add_layer_norm(x_TD, residual_TD, weight, bias, eps, x_bias)
    return y, s if keep_sum else None


def embed_layer_norm(
    ids_T: Tensor, table_VD: Tensor, weight: Tensor, bias: Tensor | None, eps: float
) -> Tensor:
    """LayerNorm(table[ids]) without materialising the gathered rows. Ids outside [0, V) are
    rejected by `encode`'s input checks; the kernel reads zeros for them rather than fault."""
    if direct_launch(table_VD, weight, bias) and ids_T.device == table_VD.device:
        return ln_fwd(table_VD, weight, bias, eps, ids=ids_T)[0].view(*ids_T.shape, table_VD.shape[-1])
    if eager_cuda(table_VD, weight, bias) and ids_T.device == table_VD.device:
        return _embed_layer_norm_eager(ids_T, table_VD, weight, bias, eps)
    return torch.ops.packedenc.embed_layer_norm(ids_T, table_VD, weight, bias, eps)
