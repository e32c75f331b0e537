"""The position terms of one DeBERTa attention tile, shared by the forward and the backward's recompute.

Shapes: M = N = BLOCK query / key rows of a tile, K head dim, W = 2 * BLOCK distances of the tile's
band (i - j = d0 + w), U compact slot rows. See `deberta_attention.py` for the whole kernel.

`_pos_scores` adds q_i . PK[slot(i - j)] (c2p) and k_j . PQ[slot(i - j)] (p2c) to a tile's scores:
  - rank-1 when one slot covers the tile (a row and a column vector);
  - `_band_scores`: the W slot rows of the tile's distances, two band GEMMs, and a `tl.gather` that
    picks C[m, m - n + N - 1] / P[m - n + N - 1, n];
  - `_compact_scores` (COMPACT_W > 0, off by default): a far tile whose distances share fewer than U
    slots (wide log buckets) runs its band GEMMs over those U slot rows and gathers by slot.

`_c2p_half` / `_c2p_pick` (the forward's C2P_REUSE, off by default): consecutive key tiles of one
query block share half their band (tile j0 + N's upper half is tile j0's lower half), so the forward
computes c2p over N fresh slot rows per tile and carries the other N from the previous tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from packedenc.kernels.triton.deberta_slots import _slot

__all__ = ["_pos_scores", "_c2p_half", "_c2p_pick"]


@triton.jit
def _pos_scores(s, q, k, PK, PQ, SLOT, i0, j0, half, hh,
                s_pk_r, s_pq_r, offs_k, kmask, idx,
                C2P: tl.constexpr, P2C: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr,
                LOWP: tl.constexpr, COMPACT_W: tl.constexpr = 0):
    """s (M, N) fp32 plus the unscaled c2p and p2c terms of the tile (i0.., j0..).

    PK / PQ point at head hh already (row stride s_*_r). idx[m, n] = m - n + N - 1. LOWP: the band
    GEMM outputs are rounded to the input dtype before the gather (HF's c2p / p2c matmuls round
    there too), which halves the shared-memory traffic of the gather. COMPACT_W (0: off): a tile
    whose distances map to at most COMPACT_W slots (far tiles, where log buckets are wide) runs its
    band GEMMs over those slot rows only, gathering by slot instead of by distance.
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
        # nested, not `COMPACT_W > 0 and ...`: the compile-time test must keep `_compact_scores` (an
        # arange of COMPACT_W rows) out of the traced kernel when it is off
        if COMPACT_W > 0:
            if slot_hi - slot_lo < COMPACT_W:
                s = _compact_scores(s, q, k, PK, PQ, SLOT, d0, slot_lo, slot_hi, half, s_pk_r, s_pq_r, offs_k,
                                    kmask, idx, C2P, P2C, PREC, LOWP, COMPACT_W)
            else:
                s = _band_scores(s, q, k, PK, PQ, SLOT, d0, half, s_pk_r, s_pq_r, offs_k, kmask, idx,
                                 C2P, P2C, BLOCK, PREC, LOWP)
        else:
            s = _band_scores(s, q, k, PK, PQ, SLOT, d0, half, s_pk_r, s_pq_r, offs_k, kmask, idx,
                             C2P, P2C, BLOCK, PREC, LOWP)
    return s


@triton.jit
def _band_scores(s, q, k, PK, PQ, SLOT, d0, half, s_pk_r, s_pq_r, offs_k, kmask, idx,
                 C2P: tl.constexpr, P2C: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr):
    """`_pos_scores` for a band tile: the slot rows of its W = 2 * BLOCK distances, picked by distance."""
    slot_w = _slot(SLOT, d0 + tl.arange(0, 2 * BLOCK), half).to(tl.int64)
    return _picked_terms(s, q, k, PK, PQ, slot_w, kmask[None, :], idx, s_pk_r, s_pq_r, offs_k, C2P, P2C, PREC, LOWP)


@triton.jit
def _compact_scores(s, q, k, PK, PQ, SLOT, d0, slot_lo, slot_hi, half, s_pk_r, s_pq_r, offs_k, kmask, idx,
                    C2P: tl.constexpr, P2C: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
                    U: tl.constexpr):
    """`_pos_scores` for a tile with <= U distinct slots: slots are non-decreasing in the distance,
    so they are the U table rows from slot_lo (rows past slot_hi masked), picked by slot."""
    u = tl.arange(0, U)
    rows = slot_lo.to(tl.int64) + u
    mask = (u <= slot_hi - slot_lo)[:, None] & kmask[None, :]
    pick = _slot(SLOT, d0 + idx, half) - slot_lo  # (M, N) in [0, U)
    return _picked_terms(s, q, k, PK, PQ, rows, mask, pick, s_pk_r, s_pq_r, offs_k, C2P, P2C, PREC, LOWP)


@triton.jit
def _picked_terms(s, q, k, PK, PQ, rows, mask, pick, s_pk_r, s_pq_r, offs_k,
                  C2P: tl.constexpr, P2C: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr):
    """s + C[m, pick[m, n]] + P[pick[m, n], n] with C = q @ PK[rows]^T (M, X) and P = PQ[rows] @ k^T
    (X, N): one GEMM per term over the given X table rows, then a `tl.gather`."""
    if C2P:
        pkr = tl.load(PK + rows[:, None] * s_pk_r + offs_k[None, :], mask=mask, other=0.0)
        c = tl.dot(q, tl.trans(pkr.to(q.dtype)), input_precision=PREC)  # (M, X)
        if LOWP:
            s += tl.gather(c.to(q.dtype), pick, axis=1).to(tl.float32)
        else:
            s += tl.gather(c, pick, axis=1)
    if P2C:
        pqr = tl.load(PQ + rows[:, None] * s_pq_r + offs_k[None, :], mask=mask, other=0.0)
        p = tl.dot(pqr.to(k.dtype), tl.trans(k), input_precision=PREC)  # (X, N)
        if LOWP:
            s += tl.gather(p.to(k.dtype), pick, axis=0).to(tl.float32)
        else:
            s += tl.gather(p, pick, axis=0)
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
