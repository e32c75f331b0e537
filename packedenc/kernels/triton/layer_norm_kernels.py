"""The LayerNorm kernels and their launchers: forward (plain, residual add, embedding gather) and backward.

Shapes: T packed tokens, D hidden, V vocab, P backward programs, k parameter gradients summed at once.

Forward `_ln_fwd_kernel`: a program normalises BLOCK_T whole rows held in registers; fp32
statistics with the centred (two-pass) variance, one rounding. With a residual it first rounds
x + residual to the activation dtype, exactly as two eager ops would, stores that sum (the new
residual) and normalises it; an `x_bias` (the bias of the GEMM that produced x, which then runs
without it) is added to x in fp32 first, inside the same rounding. With ids it gathers the rows
from the embedding table instead.
Backward `_ln_bwd_kernel`: P <= BWD_PROGRAMS programs each own a fixed contiguous range of row tiles,
recompute the statistics, write dx and one fp32 partial row each of dweight, dbias and (with an
x_bias) d x_bias = column sums of the fp32 dx, into one (P, k, D) buffer; `colsum.py` sums its
P rows (one cast then gives all k). The partition and the order of every sum depend only on T, so
the backward is deterministic (no atomics).

The registered ops and the Ops-table entries that launch these are in `layer_norm.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from packedenc.kernels.triton._common import cdiv, check_float, launch, row_tile, rows
from packedenc.kernels.triton.colsum import colsum

__all__ = ["ln_fwd", "ln_bwd", "BWD_PROGRAMS"]


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
    eps = tl.cast(eps, tl.float32)  # torch.compile passes Python floats as fp64
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
    eps = tl.cast(eps, tl.float32)  # torch.compile passes Python floats as fp64
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


def _can_overwrite(x: Tensor, residual: Tensor) -> bool:
    """x and the residual can take y and the sum in place: contiguous, one dtype, separate storage."""
    return (x.is_contiguous() and residual.is_contiguous() and x.dtype == residual.dtype
            and x.untyped_storage().data_ptr() != residual.untyped_storage().data_ptr())


def ln_fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
    residual: Tensor | None = None, ids: Tensor | None = None, x_bias: Tensor | None = None,
    keep_sum: bool = True, tile: tuple[int, int] | None = None, in_place: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Launch the forward. Return (y, rounded sum or None). With `ids`, `x` is the (V, D) table;
    `x_bias` (D,) is added to x with the residual (x + x_bias + residual, one rounding). Without
    `keep_sum` the sum is not written (a quarter of add_layer_norm's memory traffic) and is None.
    `tile` (rows per program, warps) overrides the width's default (`row_tile`): the tile probe.
    `in_place` (with a residual): y is written into x and the sum into residual when both are
    contiguous, of one dtype and in separate storage (a program reads its rows whole before it
    writes them, and no program reads another's rows), else new tensors are allocated."""
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
    if in_place and residual is not None and _can_overwrite(x, residual):
        y, s = x, residual if keep_sum else None
    else:
        y = torch.empty(out_shape, dtype=dtype, device=x.device)
        s = torch.empty(out_shape, dtype=dtype, device=x.device) if residual is not None and keep_sum else None
    if T == 0:
        return y, s
    BLOCK_T, BLOCK_D, num_warps = row_tile(D)
    if tile is not None:
        BLOCK_T, num_warps = tile
    y2 = y if y.dim() == 2 else y.view(-1, D)
    s2 = y2 if s is None else s if s.dim() == 2 else s.view(-1, D)
    ids_ = ids.contiguous() if ids is not None else x2  # unused pointer when not gathering
    launch(_ln_fwd_kernel, (cdiv(T, BLOCK_T),),
        x2, res2 if residual is not None else x2, x_bias.contiguous() if x_bias is not None else weight, ids_,
        weight.contiguous(),
        bias.contiguous() if bias is not None else weight, y2, s2,
        T, x2.shape[0], D,
        x2.stride(0), res2.stride(0) if residual is not None else 0, D, D,  # y and the sum are new (T, D)
        eps,
        HAS_RES=residual is not None, HAS_XB=x_bias is not None, GATHER=ids is not None,
        HAS_BIAS=bias is not None, STORE_SUM=s is not None,
        BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=num_warps,
    )
    return y, s


# Programs of the backward: many short ones, so that a partly filled last wave costs little. At
# D = 768 the kernel takes 140 registers a thread (2 warps; ptxas for sm_90), so an SM holds 7
# programs. 1024 programs of 1-row tiles were the best of 12 (rows, warps, programs) settings at
# 64k tokens (norm_probe_h200.json: 8192 programs tie there and are 20-28% slower below), and
# their (P, D) fp32 partials stay small (3 MB at D = 768) for the sum that follows. Below
# SHORT_PACK tokens (training batches of a few thousand) 2-row tiles over 512 programs: half the
# partial rows to sum, 13.4 vs 17.0 us at 4k tokens and 41.5 vs 44.2 at 16k (norm_probe_h200.json).
BWD_PROGRAMS = 1024
SHORT_PACK, SHORT_PROGRAMS, SHORT_ROWS = 32768, 512, 2


def ln_bwd(
    dy: Tensor, x: Tensor, weight: Tensor, eps: float,
    dsum: Tensor | None = None, ids: Tensor | None = None, need_db: bool = True, need_dxb: bool = False,
    programs: int | None = None, tile: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Launch the backward. Return (dx (T, D) in x's dtype, sums (k, D) fp32): the rows of `sums`
    are dweight, then dbias if `need_db`, then d x_bias (column sums of dx) if `need_dxb`. `programs`
    caps the programs (default by T, see BWD_PROGRAMS; tests use few, so that one program owns
    several tiles); `tile` (rows per tile, warps) overrides the default, as in `ln_fwd`."""
    D = x.shape[-1]
    dy2, x2 = rows(dy), rows(x)
    T = dy2.shape[0]
    dx = torch.empty((T, D), dtype=x.dtype, device=x.device)
    # One row per tile (two below SHORT_PACK): the best backward tiles measured (norm_probe_h200.json).
    BLOCK_T, BLOCK_D, num_warps = row_tile(D, target=1024)
    short = bool(T < SHORT_PACK)  # bool(): a symbolic T (dynamic shapes) guards on the comparison
    if tile is not None:
        BLOCK_T, num_warps = tile
    elif short:
        BLOCK_T *= SHORT_ROWS
    if programs is None:
        programs = SHORT_PROGRAMS if short else BWD_PROGRAMS
    n_tiles = cdiv(T, BLOCK_T)
    tiles_per_prog = max(1, cdiv(n_tiles, programs))  # fixed by T alone: deterministic sums
    P = max(1, cdiv(n_tiles, tiles_per_prog))
    # Every program writes its partial rows, so the buffer needs no fill (zeros when T == 0: no
    # launch). One (P, k, D) buffer: one sum for every parameter gradient (was a sum and a cast each).
    part = (torch.empty if T else torch.zeros)((P, 1 + need_db + need_dxb, D), dtype=torch.float32, device=x.device)
    if T:
        ds2 = rows(dsum) if dsum is not None else dy2
        launch(_ln_bwd_kernel, (P,),
            dy2, x2, ids.contiguous() if ids is not None else dy2, weight.contiguous(), ds2, dx, part,
            T, x2.shape[0], D, tiles_per_prog,
            dy2.stride(0), x2.stride(0), ds2.stride(0), dx.stride(0),
            eps,
            HAS_DSUM=dsum is not None, HAS_DB=need_db, HAS_DXB=need_dxb, K=part.shape[1], GATHER=ids is not None,
            BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=num_warps,
        )
    return dx, colsum(part)
