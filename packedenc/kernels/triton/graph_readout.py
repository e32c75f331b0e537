"""GiGL's anchor_neighbor_attention readout: one program per sequence, one read of its tokens.

Shapes: T packed tokens, S sequences, D hidden.

out_s = z_anchor + sum_{t >= 1} w_t z_t, w = softmax_t(weight . [z_anchor, z_t] + bias) over the
sequence's neighbours (`reference.graph_readout`). The reference materialises fp32 copies of z and
of w_t z_t and segment-sums them with atomics (~10 (T, D) fp32 passes forward, more backward).
`_fwd_kernel` streams the sequence's rows once, scores them in fp32 and keeps an online softmax
and the weighted sum in fp32 registers; it also writes the softmax's max and denominator (S,) for
the backward. `_bwd_kernel` streams the rows twice (sum_t w_t dw_t, then dz), writes dz once and
one fp32 partial row of dweight and dbias per sequence, which torch sums (no atomics).

Sequences are short (graph neighbourhoods, <= a few hundred tokens); a very long one is handled
by one program, serially (correct, not fast).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from packedenc.kernels import reference
from packedenc.kernels.triton._common import (
    check_float, direct_launch, eager_autograd, eager_cuda, launch, launch_or_op, row_tile,
)

__all__ = ["graph_readout", "readout_fwd", "readout_bwd", "readout_bwd_reference"]


@triton.jit
def _anchor_and_weights(Z, W, B, start, stride_z, D, cols, cmask, has_anchor, HAS_BIAS: tl.constexpr):
    """(z_anchor, w_anchor half, w_neighbour half, anchor score + bias), fp32. has_anchor: (BLOCK_D,)
    bool, all equal (a vector: the interpreter rejects scalar & vector masks)."""
    w0 = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    w1 = tl.load(W + D + cols, mask=cmask, other=0.0).to(tl.float32)
    za = tl.load(Z + start.to(tl.int64) * stride_z + cols, mask=cmask & has_anchor, other=0.0).to(tl.float32)
    c = tl.sum(za * w0, 0)
    if HAS_BIAS:
        c += tl.load(B).to(tl.float32)
    return za, w0, w1, c


@triton.jit
def _fwd_kernel(
    Z,  # (T, D) packed final states (row stride stride_z, columns contiguous)
    W,  # (2D,) readout weight: [:D] scores the anchor, [D:] the neighbour
    B,  # (1,) readout bias (HAS_BIAS)
    CU,  # (S + 1,) int32 cu_seqlens
    OUT,  # (S, D) out, z's dtype
    M, L,  # (S,) fp32 out: softmax max and denominator over the neighbours (0 / 0 without any)
    D, stride_z, stride_o,
    HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0)
    start = tl.load(CU + s)
    end = tl.load(CU + s + 1)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    za, w0, w1, c = _anchor_and_weights(Z, W, B, start, stride_z, D, cols, cmask, cols * 0 + start < end, HAS_BIAS)
    m = tl.max(tl.full([BLOCK_T], float("-inf"), tl.float32), 0)  # fp32 scalars carried by the loop
    den = tl.sum(tl.zeros([BLOCK_T], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for t0 in range(start + 1, end, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        rmask = rows < end
        z = tl.load(Z + rows.to(tl.int64)[:, None] * stride_z + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        sc = tl.where(rmask, tl.sum(z * w1[None, :], 1) + c, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 0))  # finite: the tile has >= 1 real row
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new)
        den = den * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * z, 0)
        m = m_new
    has_nb = den > 0.0
    out = za + acc / tl.where(has_nb, den, 1.0)
    tl.store(OUT + s.to(tl.int64) * stride_o + cols, out.to(OUT.dtype.element_ty), mask=cmask)
    tl.store(M + s, tl.where(has_nb, m, 0.0))
    tl.store(L + s, den)


@triton.jit
def _bwd_kernel(
    G,  # (S, D) gradient of the output
    Z, W, B, CU, M, L,  # as in the forward (M, L: its saved statistics)
    DZ,  # (T, D) out: gradient of z, z's dtype
    DW,  # (S, 2D) fp32 out: per-sequence partial of dweight
    DB,  # (S,) fp32 out: per-sequence partial of dbias
    D, stride_z, stride_g, stride_dz,
    HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0)
    s64 = s.to(tl.int64)
    start = tl.load(CU + s)
    end = tl.load(CU + s + 1)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    has_anchor = cols * 0 + start < end  # (BLOCK_D,): see _anchor_and_weights
    za, w0, w1, c = _anchor_and_weights(Z, W, B, start, stride_z, D, cols, cmask, has_anchor, HAS_BIAS)
    g = tl.load(G + s64 * stride_g + cols, mask=cmask, other=0.0).to(tl.float32)
    m = tl.load(M + s)
    den = tl.load(L + s)
    inv = 1.0 / tl.where(den > 0.0, den, 1.0)
    # pass 1: sum_t w_t dw_t, where dw_t = g . z_t is the gradient of the weight w_t
    tot = tl.sum(tl.zeros([BLOCK_T], tl.float32), 0)
    for t0 in range(start + 1, end, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        rmask = rows < end
        z = tl.load(Z + rows.to(tl.int64)[:, None] * stride_z + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        w = tl.where(rmask, tl.exp(tl.sum(z * w1[None, :], 1) + c - m) * inv, 0.0)
        tot += tl.sum(w * tl.sum(z * g[None, :], 1), 0)
    # pass 2: ds_t = w_t (dw_t - tot) (softmax backward); dz_t = w_t g + ds_t w1
    dw1 = tl.zeros([BLOCK_D], tl.float32)
    ds_sum = tl.sum(tl.zeros([BLOCK_T], tl.float32), 0)
    for t0 in range(start + 1, end, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        rmask = rows < end
        mask2 = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        z = tl.load(Z + r64 * stride_z + cols[None, :], mask=mask2, other=0.0).to(tl.float32)
        w = tl.where(rmask, tl.exp(tl.sum(z * w1[None, :], 1) + c - m) * inv, 0.0)
        ds = w * (tl.sum(z * g[None, :], 1) - tot)
        dz = w[:, None] * g[None, :] + ds[:, None] * w1[None, :]
        tl.store(DZ + r64 * stride_dz + cols[None, :], dz.to(DZ.dtype.element_ty), mask=mask2)
        dw1 += tl.sum(ds[:, None] * z, 0)
        ds_sum += tl.sum(ds, 0)
    # the anchor: the output's identity term, plus its part of every score (zero in exact
    # arithmetic, since the scores' shared term cancels in the softmax; kept as the reference has it)
    dza = g + ds_sum * w0
    tl.store(DZ + start.to(tl.int64) * stride_dz + cols, dza.to(DZ.dtype.element_ty), mask=cmask & has_anchor)
    tl.store(DW + s64 * 2 * D + cols, ds_sum * za, mask=cmask)
    tl.store(DW + s64 * 2 * D + D + cols, dw1, mask=cmask)
    tl.store(DB + s, ds_sum)


# ---- launchers (CUDA, or CPU tensors under TRITON_INTERPRET=1) ---------------------------------


def _tile(D: int) -> tuple[int, int, int]:
    block_t, block_d, warps = row_tile(D)
    return max(2, block_t), block_d, warps  # >= 2 rows: a tile's reductions stay 2-D


def _rows(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 and (x.shape[0] <= 1 or x.stride(0) >= x.shape[1]) else x.contiguous()


def readout_fwd(
    z_TD: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor, block_t: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the forward. Return (out (S, D) in z's dtype, max (S,) fp32, denominator (S,) fp32).

    `block_t` (rows per step) is for tests: small tiles give several steps on a tiny input."""
    check_float("graph_readout", z_TD, weight)
    T, D = z_TD.shape
    S = cu_seqlens.numel() - 1
    assert weight.numel() == 2 * D and (bias is None or bias.numel() == 1)
    z = _rows(z_TD)
    out = torch.empty((S, D), dtype=z_TD.dtype, device=z_TD.device)
    m = torch.empty((S,), dtype=torch.float32, device=z_TD.device)
    den = torch.empty((S,), dtype=torch.float32, device=z_TD.device)
    if S <= 0:
        return out, m, den
    BT, BD, warps = _tile(D)
    w = weight.reshape(-1).contiguous()
    launch(_fwd_kernel, (S,),
        z, w, bias.reshape(-1).contiguous() if bias is not None else w, cu_seqlens.contiguous(), out, m, den,
        D, z.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_T=block_t or BT, BLOCK_D=BD, num_warps=warps,
    )
    return out, m, den


def readout_bwd(
    g_SD: Tensor, z_TD: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor, m_S: Tensor,
    den_S: Tensor, block_t: int | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Launch the backward. Return (dz (T, D) in z's dtype, dweight like weight, dbias like bias)."""
    T, D = z_TD.shape
    S = cu_seqlens.numel() - 1
    z, g = _rows(z_TD), _rows(g_SD)
    # every row of dz is written: each token belongs to one sequence (its anchor or a neighbour);
    # rows outside [cu[0], cu[S]) cannot exist (cu ends at T, starts at 0)
    dz = torch.empty((T, D), dtype=z_TD.dtype, device=z_TD.device)
    dw = torch.zeros((max(S, 1), 2 * D), dtype=torch.float32, device=z_TD.device)
    db = torch.zeros((max(S, 1),), dtype=torch.float32, device=z_TD.device)
    if S > 0:
        BT, BD, warps = _tile(D)
        w = weight.reshape(-1).contiguous()
        launch(_bwd_kernel, (S,),
            g, z, w, bias.reshape(-1).contiguous() if bias is not None else w, cu_seqlens.contiguous(),
            m_S, den_S, dz, dw, db, D, z.stride(0), g.stride(0), dz.stride(0),
            HAS_BIAS=bias is not None, BLOCK_T=block_t or BT, BLOCK_D=BD, num_warps=warps,
        )
    dweight = dw.sum(0).view(weight.shape).to(weight.dtype)
    dbias = None if bias is None else db.sum(0).view(bias.shape).to(bias.dtype)
    return dz, dweight, dbias


# ---- registered ops (CPU: the reference; CUDA: the kernels) ------------------------------------


def _readout_cuda(z, weight, bias, cu_seqlens, max_seqlen):
    return readout_fwd(z, weight, bias, cu_seqlens)


@triton_op("packedenc::graph_readout", mutates_args=())
def _readout(z: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor, max_seqlen: int
             ) -> tuple[Tensor, Tensor, Tensor]:
    if z.is_cuda:
        return _readout_cuda(z, weight, bias, cu_seqlens, max_seqlen)
    out = reference.graph_readout(z, weight, bias, cu_seqlens, max_seqlen)
    S = cu_seqlens.numel() - 1  # the CPU backward recomputes through the reference: stats unused
    return out, z.new_zeros((S,), dtype=torch.float32), z.new_zeros((S,), dtype=torch.float32)


def readout_bwd_reference(g_SD: Tensor, z_TD: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor | None]:
    """The gradients of `reference.graph_readout` in plain torch, fp32 (the CPU backward).

    With w_t the softmax weights and dw_t = g . z_t: ds_t = w_t (dw_t - sum_t' w_t' dw_t'), then
    dz_t = w_t g + ds_t w1 for neighbours, g + (sum_t ds_t) w0 for the anchor, dw1 = sum_t ds_t z_t,
    dw0 = sum_s (sum_t ds_t) z_anchor, dbias = sum_t ds_t.
    """
    from packedenc.packing import positions_from_cu_seqlens, segment_ids

    T, D = z_TD.shape
    S = cu_seqlens.numel() - 1
    seg = segment_ids(cu_seqlens, T)
    anchor_T = positions_from_cu_seqlens(cu_seqlens, T) == 0
    starts = cu_seqlens[:-1].long()
    z, g = z_TD.float(), g_SD.float()
    w0, w1 = weight.float().reshape(2, D)
    za = z.index_select(0, starts)
    s_T = (z @ w1 + (za @ w0)[seg] + (0.0 if bias is None else bias.float())).masked_fill(anchor_T, float("-inf"))
    m = torch.full((S,), float("-inf"), device=z.device).scatter_reduce(0, seg, s_T, "amax")
    e = torch.exp(s_T - torch.where(torch.isfinite(m), m, 0.0)[seg])
    den = torch.zeros(S, device=z.device).index_add(0, seg, e)
    w_T = e / den.clamp_min(torch.finfo(torch.float32).tiny)[seg]
    dw_T = (z * g[seg]).sum(1)
    tot = torch.zeros(S, device=z.device).index_add(0, seg, w_T * dw_T)
    ds_T = w_T * (dw_T - tot[seg])
    ds_S = torch.zeros(S, device=z.device).index_add(0, seg, ds_T)
    dz = w_T[:, None] * g[seg] + ds_T[:, None] * w1
    dz = dz.index_add(0, starts, g + ds_S[:, None] * w0)
    dweight = torch.cat([ds_S @ za, ds_T @ z]).view(weight.shape).to(weight.dtype)
    dbias = None if bias is None else ds_S.sum().view(bias.shape).to(bias.dtype)
    return dz.to(z_TD.dtype), dweight, dbias


def _readout_bwd_cuda(g, z, weight, bias, cu_seqlens, m, den):
    dz, dw, db = readout_bwd(g, z, weight, bias, cu_seqlens, m, den)
    return dz, dw, db if db is not None else weight.new_empty((0,))


@triton_op("packedenc::graph_readout_bwd", mutates_args=())
def _readout_bwd(g: Tensor, z: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor, m: Tensor,
                 den: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    if g.is_cuda:
        return _readout_bwd_cuda(g, z, weight, bias, cu_seqlens, m, den)
    dz, dw, db = readout_bwd_reference(g, z, weight, bias, cu_seqlens)
    return dz, dw, db if db is not None else weight.new_empty((0,))  # an op cannot return None


def _setup(ctx, inputs, output):
    z, weight, bias, cu_seqlens, _ = inputs
    ctx.save_for_backward(z, weight, bias, cu_seqlens, output[1], output[2])
    ctx.has_bias = bias is not None
    ctx.set_materialize_grads(False)  # the statistics' gradients are never read: no zeros for them


def _backward(ctx, g, dm, dden):
    if g is None:  # only the statistics of the raw op were used: they carry no gradient
        return None, None, None, None, None
    z, weight, bias, cu_seqlens, m, den = ctx.saved_tensors
    dz, dw, db = launch_or_op(_readout_bwd_cuda, torch.ops.packedenc.graph_readout_bwd, g, z, weight,
                              bias if ctx.has_bias else None, cu_seqlens, m, den)
    return dz, dw, db if ctx.has_bias else None, None, None


_readout.register_autograd(_backward, setup_context=_setup)
_readout_eager = eager_autograd(_readout_cuda, _setup, _backward)


# ---- the Ops-table entry: the reference signature ----------------------------------------------


def graph_readout(z_TD: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
    """`reference.graph_readout` (same signature and math: fp32 scores, softmax and sums, one rounding).

    Arguments:
        z_TD: (T, D) packed final states, each sequence's anchor first; float16 / bfloat16 / float32.
        weight: (1, 2D) readout weight (anchor half first). bias: (1,) or None.
        cu_seqlens: (S+1,) int32 on z's device. max_seqlen: host int (not needed by the kernels).
    Return:
        (S, D) in z's dtype.
    """
    check_float("graph_readout", z_TD, weight)
    if direct_launch(z_TD, weight, bias):
        return readout_fwd(z_TD, weight, bias, cu_seqlens)[0]
    if eager_cuda(z_TD, weight, bias):
        return _readout_eager(z_TD, weight, bias, cu_seqlens, max_seqlen)[0]
    return torch.ops.packedenc.graph_readout(z_TD, weight, bias, cu_seqlens, max_seqlen)[0]
