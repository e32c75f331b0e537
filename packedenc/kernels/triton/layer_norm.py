"""LayerNorm, residual add + LayerNorm, and embedding gather + LayerNorm: one Triton kernel each way.

Shapes: T packed tokens, D hidden, V vocab, P backward programs, k parameter gradients summed at once.

Forward `_ln_fwd_kernel`: a program normalises BLOCK_T whole rows held in registers; fp32
statistics with the centred (two-pass) variance, one rounding. With a residual it first rounds
x + residual to the activation dtype, exactly as two eager ops would, stores that sum (the new
residual) and normalises it; an `x_bias` (the bias of the GEMM that produced x, which then runs
without it) is added to x in fp32 first, inside the same rounding. With ids it gathers the rows
from the embedding table instead.
Backward `_ln_bwd_kernel`: P <= BWD_PROGRAMS programs each own a fixed contiguous range of row tiles,
recompute the statistics, write dx and one fp32 partial row each of dweight, dbias and (with an
x_bias) d x_bias = column sums of the fp32 dx, into one (P, k, D) buffer: one torch sum and one
cast then give all k. The partition depends only on T, so the backward is deterministic (no atomics).

Each op is a `torch.library.custom_op` whose CPU implementation is `kernels/reference/` and whose
CUDA implementation launches the kernel; the backward is itself an op (CPU: autograd of the
reference), so `torch.compile(fullgraph=True)` traces forward and backward through fakes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from packedenc.kernels import reference
from packedenc.kernels.reference import backward as reference_bwd
from packedenc.kernels.triton._common import cdiv, check_float, direct_launch, row_tile, rows

__all__ = ["layer_norm", "add_layer_norm", "embed_layer_norm", "ln_fwd", "ln_bwd"]


@triton.jit
def _ln_fwd_kernel(
    X,  # (T, D) input rows, or (V, D) embedding table when GATHER
    RES,  # (T, D) residual added to x (HAS_RES)
    XB,  # (D,) bias added to x before the residual (HAS_XB)
    IDS,  # (T,) int row index into X (GATHER)
    W,  # (D,) weight, any float dtype
    B,  # (D,) bias (HAS_BIAS)
    Y,  # (T, D) normalised output, activation dtype
    SUM,  # (T, D) rounded x + residual (HAS_RES)
    T,  # rows to produce
    V,  # rows of X when GATHER (ids outside [0, V) read zeros instead of faulting)
    D,  # row width
    stride_x, stride_r, stride_y, stride_s,  # row strides (elements); last dims are contiguous
    eps,
    HAS_RES: tl.constexpr,
    HAS_XB: tl.constexpr,  # only with HAS_RES
    GATHER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STORE_SUM: tl.constexpr = True,  # False: the caller drops the sum (post-LN inference)
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    col = tl.arange(0, BLOCK_D)
    rmask = row < T
    cmask = col < D
    mask = rmask[:, None] & cmask[None, :]
    if GATHER:
        src = tl.load(IDS + row, mask=rmask, other=0).to(tl.int64)
        xmask = mask & ((src >= 0) & (src < V))[:, None]
    else:
        src = row
        xmask = mask
    x = tl.load(X + src[:, None] * stride_x + col[None, :], mask=xmask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(RES + row[:, None] * stride_r + col[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_XB:  # (x + x_bias) + residual in fp32, the reference's order
            x += tl.load(XB + col, mask=cmask, other=0.0).to(tl.float32)[None, :]
        s = (x + r).to(Y.dtype.element_ty)  # the eager residual add rounds here (SUM has Y's dtype)
        if STORE_SUM:
            tl.store(SUM + row[:, None] * stride_s + col[None, :], s, mask=mask)
        x = s.to(tl.float32)
    mean = tl.sum(x, axis=1) / D
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=1) / D + eps)
    w = tl.load(W + col, mask=cmask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + col, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + row[:, None] * stride_y + col[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _ln_bwd_kernel(
    DY,  # (T, D) gradient of the normalised output
    X,  # (T, D) LayerNorm input rows, or (V, D) table when GATHER
    IDS,  # (T,) int row index into X (GATHER)
    W,  # (D,) weight
    DSUM,  # (T, D) gradient reaching the LayerNorm input directly (add_layer_norm's sum output)
    DX,  # (T, D) out: gradient of the LayerNorm input rows
    PART,  # (P, K, D) fp32 out: per-program partial sums of dy * xhat, dy (HAS_DB), dx (HAS_DXB)
    T, V, D,
    tiles_per_prog,  # each program owns tiles [pid * tiles_per_prog, (pid + 1) * tiles_per_prog)
    stride_dy, stride_x, stride_ds, stride_dx,
    eps,
    HAS_DSUM: tl.constexpr,
    HAS_DB: tl.constexpr,  # False for bias-free norms (ModernBERT): no dbias work at all
    HAS_DXB: tl.constexpr,  # add_layer_norm's x_bias: its gradient is the column sums of dx
    K: tl.constexpr,  # rows of PART: 1 + HAS_DB + HAS_DXB
    GATHER: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    col = tl.arange(0, BLOCK_D)
    cmask = col < D
    w = tl.load(W + col, mask=cmask, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    db = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    dxb = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    first = pid.to(tl.int64) * tiles_per_prog * BLOCK_T
    for i in range(0, tiles_per_prog):
        row = first + i * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        rmask = row < T
        mask = rmask[:, None] & cmask[None, :]
        if GATHER:
            src = tl.load(IDS + row, mask=rmask, other=0).to(tl.int64)
            xmask = mask & ((src >= 0) & (src < V))[:, None]
        else:
            src = row
            xmask = mask
        x = tl.load(X + src[:, None] * stride_x + col[None, :], mask=xmask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row[:, None] * stride_dy + col[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / D
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=1) / D + eps)
        xhat = xc * rstd[:, None]
        wdy = w * dy
        c1 = tl.sum(xhat * wdy, axis=1) / D
        c2 = tl.sum(wdy, axis=1) / D
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if HAS_DSUM:
            dx += tl.load(DSUM + row[:, None] * stride_ds + col[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row[:, None] * stride_dx + col[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        if HAS_DB:
            db += dy
        if HAS_DXB:
            dxb += dx  # fp32, dsum included, masked elements 0
    part = PART + pid.to(tl.int64) * K * D + col
    tl.store(part, tl.sum(dw, axis=0), mask=cmask)
    if HAS_DB:
        tl.store(part + D, tl.sum(db, axis=0), mask=cmask)
    if HAS_DXB:
        tl.store(part + (K - 1) * D, tl.sum(dxb, axis=0), mask=cmask)


# ---- launchers (device-agnostic: CUDA, or CPU tensors under TRITON_INTERPRET=1) ----------------


def ln_fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
    residual: Tensor | None = None, ids: Tensor | None = None, x_bias: Tensor | None = None,
    keep_sum: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Launch the forward. Return (y, rounded sum or None). With `ids`, `x` is the (V, D) table;
    `x_bias` (D,) is added to x with the residual (x + x_bias + residual, one rounding). Without
    `keep_sum` the sum is not written (a quarter of add_layer_norm's memory traffic) and is None."""
    check_float("layer_norm", x, weight)
    D = x.shape[-1]
    assert weight.shape == (D,) and (bias is None or bias.shape == (D,))
    assert x_bias is None or (residual is not None and x_bias.shape == (D,)), "x_bias: (D,), with a residual"
    dtype = x.dtype
    if residual is not None and residual.dtype != dtype:
        dtype = torch.promote_types(x.dtype, residual.dtype)  # what `x + residual` gives
        x, residual = x.to(dtype), residual.to(dtype)
    x2 = rows(x)
    res2 = rows(residual) if residual is not None else None
    T = ids.numel() if ids is not None else x2.shape[0]
    out_shape = (T, D) if ids is not None else x.shape
    y = torch.empty(out_shape, dtype=dtype, device=x.device)
    s = torch.empty(out_shape, dtype=dtype, device=x.device) if residual is not None and keep_sum else None
    if T == 0:
        return y, s
    BLOCK_T, BLOCK_D, num_warps = row_tile(D)
    y2 = y.view(-1, D)
    s2 = s.view(-1, D) if s is not None else y2
    ids_ = ids.contiguous() if ids is not None else x2  # unused pointer when not gathering
    _ln_fwd_kernel[(cdiv(T, BLOCK_T),)](
        x2, res2 if residual is not None else x2, x_bias.contiguous() if x_bias is not None else weight, ids_,
        weight.contiguous(),
        bias.contiguous() if bias is not None else weight, y2, s2,
        T, x2.shape[0], D,
        x2.stride(0), res2.stride(0) if residual is not None else 0, y2.stride(0), s2.stride(0),
        eps,
        HAS_RES=residual is not None, HAS_XB=x_bias is not None, GATHER=ids is not None,
        HAS_BIAS=bias is not None, STORE_SUM=s is not None,
        BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=num_warps,
    )
    return y, s


# Programs of the backward: many short ones, so that a partly filled last wave costs little. At
# D = 768 the kernel takes 140 registers a thread (2 warps; ptxas for sm_90), so an SM holds 7
# programs and an H200 924: 1024 programs of 64 rows (T = 64k) make 2 waves of 64 dependent row
# iterations, which fits the measured ~154 us at T = 64k and 82 us at T = 32k (~1.2 us a row, 2.5
# TB/s). 8192 programs of 8 rows: 9 waves of 8 rows. The (P, D) fp32 partials stay small (25 MB).
BWD_PROGRAMS = 8192


def ln_bwd(
    dy: Tensor, x: Tensor, weight: Tensor, eps: float,
    dsum: Tensor | None = None, ids: Tensor | None = None, need_db: bool = True, need_dxb: bool = False,
) -> tuple[Tensor, Tensor]:
    """Launch the backward. Return (dx (T, D) in x's dtype, sums (k, D) fp32): the rows of `sums`
    are dweight, then dbias if `need_db`, then d x_bias (column sums of dx) if `need_dxb`."""
    D = x.shape[-1]
    dy2, x2 = rows(dy), rows(x)
    T = dy2.shape[0]
    dx = torch.empty((T, D), dtype=x.dtype, device=x.device)
    # One row per tile: 82 us vs 98 us for four at T=32k, D=768 on an H200 (benchmarks/NOTES.md).
    BLOCK_T, BLOCK_D, num_warps = row_tile(D, target=1024)
    n_tiles = cdiv(T, BLOCK_T)
    tiles_per_prog = max(1, cdiv(n_tiles, BWD_PROGRAMS))  # fixed by T alone: deterministic sums
    P = max(1, cdiv(n_tiles, tiles_per_prog))
    # Every program writes its partial rows, so the buffer needs no fill (zeros when T == 0: no
    # launch). One (P, k, D) buffer: one sum for every parameter gradient (was a sum and a cast each).
    part = (torch.empty if T else torch.zeros)((P, 1 + need_db + need_dxb, D), dtype=torch.float32, device=x.device)
    if T:
        ds2 = rows(dsum) if dsum is not None else dy2
        _ln_bwd_kernel[(P,)](
            dy2, x2, ids.contiguous() if ids is not None else dy2, weight.contiguous(), ds2, dx, part,
            T, x2.shape[0], D, tiles_per_prog,
            dy2.stride(0), x2.stride(0), ds2.stride(0), dx.stride(0),
            eps,
            HAS_DSUM=dsum is not None, HAS_DB=need_db, HAS_DXB=need_dxb, K=part.shape[1], GATHER=ids is not None,
            BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=num_warps,
        )
    return dx, part.sum(0)


# ---- registered ops ----------------------------------------------------------------------------


@torch.library.custom_op("packedenc::layer_norm", mutates_args=(), device_types="cpu")
def _layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    return reference.layer_norm(x, weight, bias, eps)


@_layer_norm.register_kernel("cuda")
def _(x, weight, bias, eps):
    return ln_fwd(x, weight, bias, eps)[0]


@_layer_norm.register_fake
def _(x, weight, bias, eps):
    return torch.empty_like(x)


@torch.library.custom_op("packedenc::add_layer_norm", mutates_args=(), device_types="cpu")
def _add_layer_norm(
    x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor | None, eps: float, x_bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    return reference.add_layer_norm(x, residual, weight, bias, eps, x_bias)


@_add_layer_norm.register_kernel("cuda")
def _(x, residual, weight, bias, eps, x_bias=None):
    return ln_fwd(x, weight, bias, eps, residual=residual, x_bias=x_bias)


@_add_layer_norm.register_fake
def _(x, residual, weight, bias, eps, x_bias=None):
    dtype = torch.promote_types(x.dtype, residual.dtype)
    shape = torch.broadcast_shapes(x.shape, residual.shape)
    return x.new_empty(shape, dtype=dtype), x.new_empty(shape, dtype=dtype)


@torch.library.custom_op("packedenc::embed_layer_norm", mutates_args=(), device_types="cpu")
def _embed_layer_norm(ids: Tensor, table: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    return reference.embed_layer_norm(ids, table, weight, bias, eps)


@_embed_layer_norm.register_kernel("cuda")
def _(ids, table, weight, bias, eps):
    return ln_fwd(table, weight, bias, eps, ids=ids)[0].view(*ids.shape, table.shape[-1])


@_embed_layer_norm.register_fake
def _(ids, table, weight, bias, eps):
    return table.new_empty((*ids.shape, table.shape[-1]))


# The backward op: dx of the LayerNorm input rows (gathered from `x` through `ids` when given),
# plus `dsum` (gradient arriving at the LayerNorm input from elsewhere), and the (k, D) fp32 sums:
# dweight, then dbias if `need_db` (bias-free norms skip that reduction), then d x_bias (column
# sums of dx) if `need_dxb`. One stacked output: the autograd functions cast it once and unbind.
@torch.library.custom_op("packedenc::layer_norm_bwd", mutates_args=(), device_types="cpu")
def _layer_norm_bwd(
    dy: Tensor, x: Tensor, ids: Tensor | None, dsum: Tensor | None, weight: Tensor, eps: float,
    need_db: bool = True, need_dxb: bool = False,
) -> tuple[Tensor, Tensor]:
    rows_ = F.embedding(ids, x) if ids is not None else x
    # an fp32 weight makes the reference return its sums unrounded, as the kernel's partials are
    dx, dw, db, dxb = reference_bwd.layer_norm_bwd(dy, rows_, weight.float(), eps, dsum, need_dxb=True)
    sums = [dw] + [db] * need_db + [dxb] * need_dxb
    return dx.reshape(-1, x.shape[-1]), torch.stack(sums)


@_layer_norm_bwd.register_kernel("cuda")
def _(dy, x, ids, dsum, weight, eps, need_db=True, need_dxb=False):
    return ln_bwd(dy, x, weight, eps, dsum=dsum, ids=ids, need_db=need_db, need_dxb=need_dxb)


@_layer_norm_bwd.register_fake
def _(dy, x, ids, dsum, weight, eps, need_db=True, need_dxb=False):
    D = x.shape[-1]
    T = ids.numel() if ids is not None else x.numel() // D
    return x.new_empty((T, D)), weight.new_empty((1 + need_db + need_dxb, D), dtype=torch.float32)


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
    dx, sums = torch.ops.packedenc.layer_norm_bwd(dy, x, None, None, weight, ctx.eps, ctx.has_bias)
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
        ds, sums = torch.ops.packedenc.layer_norm_bwd(dy, s, None, dsum, weight, ctx.eps, ctx.has_bias,
                                                      ctx.xb_dtype is not None)
        ds = ds.view_as(s)
        dw, db, dxb = _split(sums, weight, ctx.has_bias, ctx.xb_dtype)
    return ds.to(ctx.dtypes[0]), ds.to(ctx.dtypes[1]), dw, db, None, dxb


def _embed_ln_setup(ctx, inputs, output):
    ids, table, weight, bias, eps = inputs
    ctx.save_for_backward(ids, table, weight)
    ctx.eps, ctx.has_bias = eps, bias is not None


def _embed_ln_backward(ctx, dy):
    ids, table, weight = ctx.saved_tensors
    dx, sums = torch.ops.packedenc.layer_norm_bwd(dy, table, ids.reshape(-1), None, weight, ctx.eps, ctx.has_bias)
    dw, db, _ = _split(sums, weight, ctx.has_bias)
    # embedding_dense_backward is F.embedding's own backward (sorted segment sums on CUDA).
    dtable = torch.ops.aten.embedding_dense_backward(dx, ids.reshape(-1), table.shape[0], -1, False)
    return None, dtable, dw, db, None


_layer_norm.register_autograd(_ln_backward, setup_context=_ln_setup)
_add_layer_norm.register_autograd(_add_ln_backward, setup_context=_add_ln_setup)
_embed_layer_norm.register_autograd(_embed_ln_backward, setup_context=_embed_ln_setup)


# ---- the Ops-table entries: reference signatures ----------------------------------------------


def layer_norm(x_TD: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """LayerNorm over the last dim: fp32 statistics, one rounding (see `reference.layer_norm`)."""
    if direct_launch(x_TD, weight, bias):
        return ln_fwd(x_TD, weight, bias, eps)[0]
    return torch.ops.packedenc.layer_norm(x_TD, weight, bias, eps)


def add_layer_norm(
    x_TD: Tensor, residual_TD: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
    x_bias: Tensor | None = None, keep_sum: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """(LayerNorm(x + residual), x + residual), the sum rounded before the statistics.

    `x_bias` (D,) in x's dtype, or None: the sum is x + x_bias + residual (see
    `reference.add_layer_norm`), and the backward returns its gradient from the LayerNorm
    backward kernel. A bias of the wrong shape, dtype or device raises InputError. `keep_sum`
    False (post-LN layers drop the sum) returns (y, None), and eager inference skips writing it."""
    if x_bias is not None:
        reference.check_bias("add_layer_norm", x_bias, x_TD, "x_bias")
    if direct_launch(x_TD, residual_TD, weight, bias, x_bias):
        return ln_fwd(x_TD, weight, bias, eps, residual=residual_TD, x_bias=x_bias, keep_sum=keep_sum)
    y, s = torch.ops.packedenc.add_layer_norm(x_TD, residual_TD, weight, bias, eps, x_bias)
    return y, s if keep_sum else None


def embed_layer_norm(
    ids_T: Tensor, table_VD: Tensor, weight: Tensor, bias: Tensor | None, eps: float
) -> Tensor:
    """LayerNorm(table[ids]) without materialising the gathered rows. Ids outside [0, V) are
    rejected by `encode`'s input checks; the kernel reads zeros for them rather than fault."""
    if direct_launch(table_VD, weight, bias) and ids_T.is_cuda:
        return ln_fwd(table_VD, weight, bias, eps, ids=ids_T)[0].view(*ids_T.shape, table_VD.shape[-1])
    return torch.ops.packedenc.embed_layer_norm(ids_T, table_VD, weight, bias, eps)
