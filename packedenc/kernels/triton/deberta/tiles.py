"""Tile helpers shared by the DeBERTa kernels: which sequence a program works on, the loads of its
query and key rows, the online softmax, and the forwards' key ranges and saturated (folded) tiles.

Shapes: T packed tokens, H heads, K head dim (BLOCK_K its power-of-two block), B rows of a tile,
NS key rows of a saturated tile.

The forwards (`forward.py`, `forward_wide.py`) see a query block's keys in three ranges, in
sequence order (`_key_ranges`): far behind and far ahead every pair shares one slot, so such a tile
is a plain flash tile on q + PQ[slot] and k + PK[slot] (`_fold`, `_saturated_range`); in between,
the band, every pair reads its own slot (`scores.py`). The backward (`backward.py`) reuses the
sequence span and the row loads.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_sequence_span", "_query_rows", "_key_block", "_key_ranges", "_softmax_step", "_store_rows",
           "_saturated_range", "_fold"]


@triton.jit
def _sequence_span(CU, ORDER, HAS_ORDER: tl.constexpr):
    """(start token, length) of this program's sequence (grid z; ORDER[z] when the launch passes an order).

    Programs start roughly in grid order, and a batch of ~16 ragged sequences is only ~3 waves of
    programs whose cost grows with their sequence's length: with the longest sequences first the
    short ones fill the last wave instead of one long sequence running alone (LPT scheduling).
    """
    seq = tl.program_id(2)
    if HAS_ORDER:
        seq = tl.load(ORDER + seq)
    start = tl.load(CU + seq).to(tl.int64)
    return start, (tl.load(CU + seq + 1) - tl.load(CU + seq)).to(tl.int32)


@triton.jit
def _query_rows(Q, start, i0, L, hh, s_q_t, s_q_h, offs, offs_k, kmask):
    """Query rows i0 .. i0 + B - 1 of a sequence at `start`: (token rows, row mask, q)."""
    mmask = (i0 + offs) < L
    rows = start + i0 + offs.to(tl.int64)
    q = tl.load(Q + rows[:, None] * s_q_t + hh * s_q_h + offs_k[None, :], mask=mmask[:, None] & kmask[None, :],
                other=0.0)
    return rows, mmask, q


@triton.jit
def _key_block(K, V, start, j0, L, hh, s_k_t, s_k_h, s_v_t, s_v_h, offs, offs_k, kmask):
    """Keys j0 .. j0 + B - 1 of a sequence at `start`: (token rows, key mask, (B, K) mask, k, v)."""
    nmask = (j0 + offs) < L
    cols = start + j0 + offs.to(tl.int64)
    kv_mask = nmask[:, None] & kmask[None, :]
    k = tl.load(K + cols[:, None] * s_k_t + hh * s_k_h + offs_k[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + cols[:, None] * s_v_t + hh * s_v_h + offs_k[None, :], mask=kv_mask, other=0.0)
    return cols, nmask, kv_mask, k, v


@triton.jit
def _key_ranges(i0, L, D_LO, D_HI, NS: tl.constexpr, ROWS: tl.constexpr, STEP: tl.constexpr):
    """(e1, s3): a block of ROWS queries from i0 sees its keys in three ranges, in sequence order:
    [0, e1) far behind (every d >= D_HI, whole NS tiles), [e1, s3) the band (per-pair slots, STEP
    keys per tile), [s3, L) far ahead (every d <= D_LO). Key 0 comes first, so m_i is finite after
    the first tile (a sequence has >= 1 token)."""
    e1 = tl.minimum(tl.maximum(i0 - D_HI + 1, 0) // NS * NS, L)
    gap = tl.maximum(i0 + ROWS - 1 - D_LO - e1, 0)
    s3 = tl.minimum(e1 + (gap + STEP - 1) // STEP * STEP, L)
    return e1, s3


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, PREC: tl.constexpr):
    """One online-softmax update with a (M, N) tile of log2-scaled scores (masked = -inf)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _store_rows(O, LSE, acc, m_i, l_i, rows, hh, s_o_t, s_o_h, s_lse_t, offs_k, mmask, kmask,
                STORE_LSE: tl.constexpr):
    """The block's output acc / l_i in O's dtype and, if STORE_LSE, its log2-sum-exp2 m_i + log2(l_i)."""
    out = acc / l_i[:, None]
    tl.store(O + rows[:, None] * s_o_t + hh * s_o_h + offs_k[None, :], out.to(O.dtype.element_ty),
             mask=mmask[:, None] & kmask[None, :])
    if STORE_LSE:
        tl.store(LSE + rows * s_lse_t + hh, m_i + tl.log2(l_i), mask=mmask)


@triton.jit
def _saturated_range(qf, pk_row, cst, K, V, start, L, j_lo, j_hi, hh, s_k_t, s_k_h, s_v_t, s_v_h, offs_k, kmask,
                     m_i, l_i, acc, qk_scale, NS: tl.constexpr, C2P: tl.constexpr, PREC: tl.constexpr):
    """Key blocks [j_lo, j_hi) whose every pair shares one slot: s = (q + PQ) . (k + PK) - PQ . PK.

    qf = q + PQ[slot] was formed once per program; k + PK[slot] is one add per key tile, so such a
    tile costs what a plain flash tile costs (the two extra terms ride in the same tensor-core dot).
    """
    offs_n = tl.arange(0, NS)
    for j0 in range(j_lo, j_hi, NS):
        _, nmask, _, k, v = _key_block(K, V, start, j0, L, hh, s_k_t, s_k_h, s_v_t, s_v_h, offs_n, offs_k, kmask)
        if C2P:
            k = (k.to(tl.float32) + pk_row[None, :]).to(v.dtype)
        s = tl.dot(qf, tl.trans(k), input_precision=PREC)
        s = tl.where(nmask[None, :], (s - cst) * qk_scale, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, PREC)
    return m_i, l_i, acc


@triton.jit
def _fold(q, PKh, PQh, slot, s_pk_r, s_pq_r, offs_k, kmask, C2P: tl.constexpr, P2C: tl.constexpr):
    """(q + PQ[slot] in q's dtype, PK[slot] fp32, PQ[slot] . PK[slot]) for a saturated key range."""
    pk = tl.zeros_like(offs_k).to(tl.float32)
    pq = tl.zeros_like(offs_k).to(tl.float32)
    if C2P:
        pk = tl.load(PKh + slot.to(tl.int64) * s_pk_r + offs_k, mask=kmask, other=0.0).to(tl.float32)
    if P2C:
        pq = tl.load(PQh + slot.to(tl.int64) * s_pq_r + offs_k, mask=kmask, other=0.0).to(tl.float32)
        q = (q.to(tl.float32) + pq[None, :]).to(q.dtype)
    return q, pk, tl.sum(pk * pq, 0)
