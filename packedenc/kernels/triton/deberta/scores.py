"""The position terms of one DeBERTa attention tile, shared by the forwards and the backward's recompute.

Shapes: M = N = BLOCK query / key rows of a tile, K head dim, W = 2 * BLOCK distances of the tile's
band (i - j = d0 + w). See `forward.py` for the whole kernel.

`_pos_scores` adds q_i . PK[slot(i - j)] (c2p) and k_j . PQ[slot(i - j)] (p2c) to a tile's scores:
  - rank-1 when one slot covers the tile (a row and a column vector);
  - `_band_scores`: the W slot rows of the tile's distances, two band GEMMs, and a `tl.gather` that
    picks C[m, m - n + N - 1] / P[m - n + N - 1, n].

`_c2p_half` / `_c2p_pick`: consecutive key tiles of one query block share half their c2p band (tile
j0 + N's upper half is tile j0's lower half), so the forwards compute c2p over N fresh slot rows per
tile and carry the rest from the previous tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from packedenc.kernels.triton.deberta.slots import _slot

__all__ = ["_pos_scores", "_c2p_half", "_c2p_pick"]


@triton.jit
def _pos_scores(s, q, k, PK, PQ, SLOT, i0, j0, half, hh,
                s_pk_r, s_pq_r, offs_k, kmask, idx,
                C2P: tl.constexpr, P2C: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr,
                LOWP: tl.constexpr):
    """s (M, N) fp32 plus the unscaled c2p and p2c terms of the tile (i0.., j0..).

    PK / PQ point at head hh already (row stride s_*_r). idx[m, n] = m - n + N - 1. LOWP: the band
    GEMM outputs are rounded to the input dtype before the gather (HF's c2p / p2c matmuls round
    there too), which halves the shared-memory traffic of the gather.
    """
    d0 = i0 - j0 - (BLOCK - 1)
    slot_lo = _slot(SLOT, d0, half)
    slot_hi = _slot(SLOT, d0 + 2 * BLOCK - 2, half)
    if slot_lo == slot_hi:  # one slot for the whole tile: rank-1 terms
        if C2P:
            pk = tl.load(PK + slot_lo.to(tl.int64) * s_pk_r + offs_k, mask=kmask, other=0.0).to(tl.float32)
            s += tl.sum(q.to(tl.float32) * pk[None, :], 1)[:, None]
        if P2C:
            pq = tl.load(PQ + slot_lo.to(tl.int64) * s_pq_r + offs_k, mask=kmask, other=0.0).to(tl.float32)
            s += tl.sum(k.to(tl.float32) * pq[None, :], 1)[None, :]
    else:
        s = _band_scores(s, q, k, PK, PQ, SLOT, d0, half, s_pk_r, s_pq_r, offs_k, kmask, idx,
                         C2P, P2C, BLOCK, PREC, LOWP)
    return s


@triton.jit
def _band_scores(s, q, k, PK, PQ, SLOT, d0, half, s_pk_r, s_pq_r, offs_k, kmask, idx,
                 C2P: tl.constexpr, P2C: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr):
    """`_pos_scores` for a band tile: s + C[m, idx[m, n]] + P[idx[m, n], n] with C = q @ PK_w^T (M, W)
    and P = PQ_w @ k^T (W, N) over the slot rows of its W = 2 * BLOCK distances: one GEMM per term,
    then a `tl.gather`."""
    slot_w = _slot(SLOT, d0 + tl.arange(0, 2 * BLOCK), half).to(tl.int64)
    mask = kmask[None, :]
    if C2P:
        pkr = tl.load(PK + slot_w[:, None] * s_pk_r + offs_k[None, :], mask=mask, other=0.0)
        c = tl.dot(q, tl.trans(pkr.to(q.dtype)), input_precision=PREC)  # (M, W)
        if LOWP:
            s += tl.gather(c.to(q.dtype), idx, axis=1).to(tl.float32)
        else:
            s += tl.gather(c, idx, axis=1)
    if P2C:
        pqr = tl.load(PQ + slot_w[:, None] * s_pq_r + offs_k[None, :], mask=mask, other=0.0)
        p = tl.dot(pqr.to(k.dtype), tl.trans(k), input_precision=PREC)  # (W, N)
        if LOWP:
            s += tl.gather(p.to(k.dtype), idx, axis=0).to(tl.float32)
        else:
            s += tl.gather(p, idx, axis=0)
    return s


@triton.jit
def _c2p_half(q, PK, SLOT, d_lo, half, s_pk_r, offs_k, kmask, N: tl.constexpr, PREC: tl.constexpr,
              LOWP: tl.constexpr):
    """q @ PK[slot(d_lo + u)]^T for u in [0, N): half a tile's c2p band, (M, N), in q's dtype if LOWP."""
    slot_u = _slot(SLOT, d_lo + tl.arange(0, N), half).to(tl.int64)
    pkr = tl.load(PK + slot_u[:, None] * s_pk_r + offs_k[None, :], mask=kmask[None, :], other=0.0)
    c = tl.dot(q, tl.trans(pkr.to(q.dtype)), input_precision=PREC)
    if LOWP:
        c = c.to(q.dtype)
    return c


@triton.jit
def _c2p_pick(s, c_lo, c_hi, idx, N: tl.constexpr):
    """s + C[m, idx[m, n]] with C = [c_lo | c_hi], a tile's c2p band held as two (M, N) halves."""
    lo = tl.gather(c_lo, tl.minimum(idx, N - 1), axis=1)
    hi = tl.gather(c_hi, tl.maximum(idx - N, 0), axis=1)
    return s + tl.where(idx < N, lo, hi).to(tl.float32)
