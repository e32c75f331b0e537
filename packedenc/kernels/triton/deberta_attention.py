"""DeBERTa-v2/v3 disentangled attention (content + c2p + p2c) over cu_seqlens: a packed flash kernel.

Shapes: T packed tokens, S sequences, H heads, K head dim, R = 2 * span position-table rows,
M = N = BLOCK query / key rows of a tile, W = 2 * BLOCK distances of a tile's band.

The score of query i and key j of one sequence (see `reference.deberta_attention`) is
    scale * (q_i . k_j + q_i . PK[slot(i - j)] + k_j . PQ[slot(i - j)]),
slot(d) = clamp(bucket(d) + span, 0, R - 1); c2p and p2c read the same slot (bucket is odd).

`_fwd_kernel`: one program per (query block, head, sequence), looping over the key blocks of its
own sequence with an online softmax (exp2, fp32 statistics), so no (L, L) or (L, R) tensor ever
exists in device memory. Slots are non-decreasing in d and constant beyond the bucket range
(`deberta_slots.saturation`: d >= D_HI has SLOT_MAX, d <= D_LO has SLOT_MIN), so a query block's
keys fall in three ranges, in sequence order:
  - far behind (every d >= D_HI) and far ahead (every d <= D_LO): one slot for every pair, so
    q.k + q.PK[s] + k.PQ[s] = (q + PQ[s]) . (k + PK[s]) - PQ[s].PK[s]: q + PQ[s] is formed once
    per program, k + PK[s] is one add per key tile, and the tile is a plain flash tile (NS keys,
    `SATURATED_TILE` x BLOCK). Most tiles of a long sequence are such tiles.
  - the band in between, in (BLOCK, BLOCK) tiles: i - j takes the M + N - 1 values d0 + u,
    u = m - n + N - 1 in [0, W - 1), d0 = i0 - j0 - (N - 1); the kernel reads the W slots of those
    distances from the table, gathers the W rows of PK and PQ at those slots (L2-resident),
    computes the band GEMMs C = q @ PK_w^T (M, W) and P = PQ_w @ k^T (W, N) in fp32 and picks
    C[m, m - n + N - 1] and P[m - n + N - 1, n] with `tl.gather`. Cost of a band tile (M = N = B):
    2B^2K (q k^T) + 4B^2K (C) + 4B^2K (P) + 2B^2K (p V) FLOPs, 3x a flash tile. C2P_REUSE (on):
    key tile j0 + N's upper half of C is tile j0's lower half, so C is held as two (M, N) halves
    and only the lower one is computed per tile (2B^2K), 2.5x a flash tile; sequences of
    <= ~2 x max_relative_positions tokens are all band.
On the GPU, batches longer than 32 tokens with head dims <= 64 take `deberta_fwd_wide.py`
instead: the same ranges and math on (64, 32) band tiles, whose GEMMs are wgmma (WIDE_TILES).
The fold rounds q + PQ and k + PK to the input dtype once: the same order of error as storing q
and k in that dtype.

The slot table (`deberta_slots.py`) is built once per (buckets, max_relative_positions, R,
device) on the CPU, op for op HF's `make_log_bucket_position`, for every |d| <=
max(8192, next_pow2(max_seqlen)); the kernels only ever look slots up.

A tile's position terms (band, compact or rank-1) are `deberta_scores.py`; the backward
(`deberta_attention_bwd.py`) recomputes the tiles with the same helpers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from packedenc.kernels import reference
from packedenc.kernels.triton._common import cdiv, check_float, direct_launch, next_pow2
from packedenc.packing import check_seq_order
# the relative-position slot table, built once per config and device
from packedenc.kernels.triton.deberta_slots import NO_SATURATION, launch_tables, slot_table, table_slots
# a tile's c2p + p2c scores (band, compact or rank-1), shared with the backward's recompute
from packedenc.kernels.triton.deberta_scores import _c2p_half, _c2p_pick, _pos_scores

__all__ = ["deberta_attention", "deberta_attention_fwd", "slot_table", "table_slots", "block_size", "launch_config",
           "register_cap", "seq_chunks"]

LOG2E = 1.4426950408889634


# ---- forward kernel ----------------------------------------------------------------------------


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


@triton.jit
def _fwd_kernel(
    Q, K, V,  # (T, H, K) views, head dim contiguous (slices of the fused qkv output)
    PK, PQ,  # (R, H, K) position tables for c2p / p2c (any valid pointer when the term is off)
    SLOT,  # (2 * half + 1,) int32 slot of each distance
    CU,  # (S + 1,) int32 cu_seqlens
    ORDER,  # (S,) int32 permutation of the sequences, grid z -> sequence (HAS_ORDER)
    O,  # (T, H, K) out, q's dtype
    LSE,  # (T, H) fp32 out: log2-sum-exp2 of the scores times log2(e) (STORE_LSE)
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h,  # strides in elements
    s_pk_r, s_pk_h, s_pq_r, s_pq_h, s_o_t, s_o_h, s_lse_t,
    half,  # table half width
    D_LO, D_HI, SLOT_MIN, SLOT_MAX,  # `saturation`: d <= D_LO has SLOT_MIN, d >= D_HI has SLOT_MAX
    qk_scale,  # scale * log2(e)
    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,  # head dim, its power-of-two block (>= 16)
    BLOCK: tl.constexpr,  # query rows = key rows of a banded tile (>= 16 for tl.dot)
    NS: tl.constexpr,  # key rows of a saturated tile (a multiple of BLOCK)
    C2P: tl.constexpr, P2C: tl.constexpr, STORE_LSE: tl.constexpr,
    PREC: tl.constexpr,  # tl.dot input_precision ("ieee" for fp32 inputs)
    LOWP: tl.constexpr,  # band scores gathered in the input dtype (`_pos_scores`)
    COMPACT_W: tl.constexpr,  # far tiles with <= COMPACT_W slots take the compact band (0: off)
    C2P_REUSE: tl.constexpr = False,  # c2p band: BLOCK fresh slot rows per tile, the rest carried
    HAS_ORDER: tl.constexpr = False,
):
    pid_m, h = tl.program_id(0), tl.program_id(1)
    start, L = _sequence_span(CU, ORDER, HAS_ORDER)
    i0 = pid_m * BLOCK
    if i0 >= L:  # this sequence is shorter than the grid's max_seqlen
        return
    hh = h.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < HEAD_DIM
    rows, mmask, q = _query_rows(Q, start, i0, L, hh, s_q_t, s_q_h, offs, offs_k, kmask)
    idx = offs[:, None] - offs[None, :] + (BLOCK - 1)  # band column of pair (m, n)
    PKh = PK + hh * s_pk_h
    PQh = PQ + hh * s_pq_h

    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_K], tl.float32)
    e1, s3 = _key_ranges(i0, L, D_LO, D_HI, NS, BLOCK, BLOCK)
    qf, pk_row, cst = _fold(q, PKh, PQh, SLOT_MAX, s_pk_r, s_pq_r, offs_k, kmask, C2P, P2C)
    m_i, l_i, acc = _saturated_range(qf, pk_row, cst, K, V, start, L, 0, e1, hh, s_k_t, s_k_h, s_v_t, s_v_h,
                                     offs_k, kmask, m_i, l_i, acc, qk_scale, NS, C2P, PREC)
    if C2P and C2P_REUSE:  # the upper half of the first band tile's c2p band: distances d0(e1) + BLOCK ..
        c_hi = _c2p_half(q, PKh, SLOT, i0 - e1 + 1, half, s_pk_r, offs_k, kmask, BLOCK, PREC, LOWP)
    for j0 in range(e1, s3, BLOCK):
        _, nmask, _, k, v = _key_block(K, V, start, j0, L, hh, s_k_t, s_k_h, s_v_t, s_v_h, offs, offs_k, kmask)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        if C2P and C2P_REUSE:  # lower half fresh (distances d0 ..), upper half = the previous tile's lower half
            c_lo = _c2p_half(q, PKh, SLOT, i0 - j0 - (BLOCK - 1), half, s_pk_r, offs_k, kmask, BLOCK, PREC, LOWP)
            s = _c2p_pick(s, c_lo, c_hi, idx, BLOCK)
            c_hi = c_lo
            if P2C:
                s = _pos_scores(s, q, k, PKh, PQh, SLOT, i0, j0, half, hh, s_pk_r, s_pq_r, offs_k, kmask, idx,
                                False, P2C, BLOCK, PREC, LOWP, COMPACT_W)
        elif C2P or P2C:
            s = _pos_scores(s, q, k, PKh, PQh, SLOT, i0, j0, half, hh, s_pk_r, s_pq_r, offs_k, kmask, idx,
                            C2P, P2C, BLOCK, PREC, LOWP, COMPACT_W)
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, PREC)
    qf, pk_row, cst = _fold(q, PKh, PQh, SLOT_MIN, s_pk_r, s_pq_r, offs_k, kmask, C2P, P2C)
    m_i, l_i, acc = _saturated_range(qf, pk_row, cst, K, V, start, L, s3, L, hh, s_k_t, s_k_h, s_v_t, s_v_h,
                                     offs_k, kmask, m_i, l_i, acc, qk_scale, NS, C2P, PREC)
    _store_rows(O, LSE, acc, m_i, l_i, rows, hh, s_o_t, s_o_h, s_lse_t, offs_k, mmask, kmask, STORE_LSE)


# ---- launcher ----------------------------------------------------------------------------------

# Tile rows and warps. Chosen from a no-GPU sm_90 compile of these kernels (Triton 3.9, ptxas -v):
# 32-row tiles with 8 warps use 154-210 registers without spills for head dims 32-128, while
# 64-row tiles spill 100-500 bytes per thread in the banded path (the band GEMM outputs and the
# tl.gather shuffles), and with Triton 3.6 on an H200 they fail to compile (TritonGPUPipeline).
# Module-level so a benchmark sweep can override them.
BLOCK_MAX = 32
NUM_WARPS = 4  # H200, Triton 3.6: 4 warps run the 32-row tiles 2x faster than 8 (benchmarks/NOTES.md)
NUM_STAGES = 2  # H200 with the register cap below: 8192 tokens 2.46 vs 3.00 ms for 3, doc1k equal
# Key rows of a saturated tile, in units of BLOCK: 4 pays on long sequences (8192: 2.82 vs 3.11
# ms), 2 on document packs (doc1k: 0.43 vs 0.51 ms), where saturated key ranges are short.
SATURATED_TILE = 4
SATURATED_TILE_SHORT, SHORT_MAX_SEQLEN = 2, 2048
# Band c2p / p2c scores rounded to the input dtype (fp16 / bf16) before their gather, as HF's own
# matmuls round them; fp32 inputs always gather in fp32.
LOWP_GATHER = True


def block_size(max_seqlen: int) -> int:
    """Query = key rows per tile: the smallest power of two >= max_seqlen in [16, BLOCK_MAX].

    Short batches then waste no band work on empty rows; 16 is tl.dot's minimum.
    """
    return max(16, min(BLOCK_MAX, next_pow2(max(int(max_seqlen), 1))))


# Register cap per thread (Triton's `maxnreg`) for 4-warp launches with head_dim <= 64; None: ptxas
# decides. Uncapped, the sm_90 compile of the 32-row forward uses 238 registers, so registers allow
# 2 programs per SM (shared memory, 45 KB, allows 5); 168 allows 3 at 84 bytes of spills. H200 at
# 22adb5c (profile_gpu --parts kernel): doc1k batch 0.358 vs 0.432 ms, 64k pack 4.31 vs 5.36 ms,
# 8192 tokens 2.85 vs 3.01 ms; 128 (308 bytes of spills) ties on the pack and loses on the others.
MAXNREG: int | None = 168


# Far band tiles whose distances share few slots (log buckets: at d ~ 800 about 7 of a 32-row tile's
# 63 distances) run their band GEMMs over those slots only (`_compact_scores`): 47% of doc1k's tiles
# have <= 32 (benchmarks/NOTES.md). Off until timed on a GPU.
COMPACT_BAND = False


# c2p over BLOCK fresh slot rows per band tile, the other BLOCK carried from the previous key tile
# (`deberta_scores._c2p_half`): half the c2p band GEMM, two half-width gathers. H200 at baa221d
# (fp16, H=12, K=64): doc1k 64k pack 3.84 vs 4.35 ms, 8192 tokens 2.33 vs 2.55, doc1k batches 0 / 1
# 0.33-0.34 / 0.55-0.58 vs 0.38-0.45 / 0.59-0.63; outputs within 5e-4 of the full band's (fp16).
C2P_REUSE = True


def compact_width(block: int) -> int:
    """Slot rows of a compact band tile (a tl.dot operand: >= 16), or 0 when it would not save."""
    return block // 2 if COMPACT_BAND and block >= 32 else 0


def launch_config(block: int, head_dim: int = 64) -> dict:
    """Forward launch options. Wide heads (K = 128) keep 8 warps: with 4 they spill (sm_90 ptxas)."""
    warps = 4 if block <= 16 else NUM_WARPS if head_dim <= 64 else 8
    capped = warps == 4 and head_dim <= 64  # the timed shape; wide heads are not
    return dict(num_warps=warps, num_stages=NUM_STAGES, **register_cap(MAXNREG if capped else None))


def register_cap(maxnreg: int | None) -> dict:
    """The `maxnreg` launch option when a cap is set (the CPU interpreter accepts and ignores it)."""
    return {"maxnreg": maxnreg} if maxnreg else {}


MAX_GRID_Z = 65535  # CUDA's limit on grid dim 2 (sequences): longer packs launch in chunks


def seq_chunks(cu_seqlens: Tensor):
    """(cu_seqlens view, number of sequences) per launch; the kernels read absolute offsets."""
    S = cu_seqlens.numel() - 1
    if S <= MAX_GRID_Z:  # the usual case: no slice (a tensor view costs host time)
        yield cu_seqlens, S
        return
    for c in range(0, S, MAX_GRID_Z):
        yield cu_seqlens[c:], min(MAX_GRID_Z, S - c)


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def check_inputs(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, pk: Tensor | None,
                 pq: Tensor | None) -> None:
    check_float("deberta_attention", q, k, v)
    assert q.dim() == 3 and q.shape == k.shape == v.shape, (q.shape, k.shape, v.shape)
    assert q.dtype == k.dtype == v.dtype, "deberta_attention: q, k, v must share a dtype"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "head dim must be contiguous"
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous()
    for t in (pk, pq):
        if t is not None:
            assert t.dim() == 3 and t.shape[1:] == q.shape[1:] and t.stride(-1) == 1, (t.shape, q.shape)


def deberta_attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
    pos_key: Tensor | None, pos_query: Tensor | None, position_buckets: int, max_relative_positions: int,
    scale: float, store_lse: bool = True, seq_order: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Launch the forward on (T, H, K) q / k / v. Return (o (T, H, K) contiguous, lse (T, H) fp32).
    `seq_order` (S,) int32: the sequences' launch order (`packing.longest_first`), or None.

    lse is in log2 units of the scores times log2(e) (what the backward re-exponentiates); it is
    None when store_lse is False (eager inference: one allocation less per layer). CUDA tensors,
    or CPU tensors under TRITON_INTERPRET=1.
    """
    check_inputs(q, k, v, cu_seqlens, pos_key, pos_query)
    T, H, Kd = q.shape
    S = cu_seqlens.numel() - 1
    if T == 0 or S == 0 or max_seqlen <= 0:
        return q.new_empty((T, H, Kd)), q.new_empty((T, H), dtype=torch.float32) if store_lse else None
    pos = pos_key if pos_key is not None else pos_query
    R = pos.shape[0] if pos is not None else 2
    table, half, bounds = launch_tables(position_buckets, max_relative_positions, R, max_seqlen, q.device)
    if pos is None:  # no position terms: every key block takes the plain (saturated) path
        bounds = (NO_SATURATION, -NO_SATURATION, 0, 0)
    return launch_fwd(q, k, v, cu_seqlens, max_seqlen, pos_key, pos_query, (table, half), bounds, scale,
                      c2p=pos_key is not None, p2c=pos_query is not None, store_lse=store_lse, seq_order=seq_order)


def launch_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, pos_key: Tensor | None,
               pos_query: Tensor | None, table: tuple[Tensor, int], bounds: tuple[int, int, int, int],
               scale: float, *, c2p: bool, p2c: bool, store_lse: bool,
               seq_order: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """`deberta_attention_fwd` past its checks: the slot table and saturation bounds given, each term
    switched on its own (`benchmarks/deberta_band_split.py` runs the band loop with both off); lse is
    None without store_lse. `seq_order`: the order the programs take the sequences in (`_sequence`)."""
    T, H, Kd = q.shape
    has_order = seq_order is not None and cu_seqlens.numel() - 1 <= MAX_GRID_Z  # one launch
    order = seq_order if has_order else cu_seqlens  # an unused pointer without an order
    o = torch.empty((T, H, Kd), dtype=q.dtype, device=q.device)
    # without STORE_LSE the kernel never touches its LSE pointer: o stands in for it
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device) if store_lse else None
    lse_arg = lse if store_lse else o
    pk = pos_key if pos_key is not None else q
    pq = pos_query if pos_query is not None else q
    BLOCK = block_size(max_seqlen)
    BLOCK_K = max(16, next_pow2(Kd))
    if WIDE_TILES and BLOCK == WIDE_N and max_seqlen > WIDE_N and BLOCK_K <= 64:
        _launch_wide(q, k, v, cu_seqlens, order, has_order, max_seqlen, pk, pq, table, bounds, scale, c2p, p2c,
                     store_lse, o, lse_arg)
        return o, lse
    for cu, n_seq in seq_chunks(cu_seqlens):
        _fwd_kernel[(cdiv(max_seqlen, BLOCK), H, n_seq)](
            q, k, v, pk, pq, table[0], cu, order, o, lse_arg,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            pk.stride(0), pk.stride(1), pq.stride(0), pq.stride(1), o.stride(0), o.stride(1), H,
            table[1], *bounds, scale * LOG2E,
            HEAD_DIM=Kd, BLOCK_K=BLOCK_K, BLOCK=BLOCK,
            NS=(SATURATED_TILE_SHORT if max_seqlen <= SHORT_MAX_SEQLEN else SATURATED_TILE) * BLOCK,
            C2P=c2p, P2C=p2c, STORE_LSE=store_lse, PREC=_prec(q.dtype),
            LOWP=LOWP_GATHER and q.dtype != torch.float32, COMPACT_W=compact_width(BLOCK), C2P_REUSE=C2P_REUSE,
            HAS_ORDER=has_order, **launch_config(BLOCK, Kd),
        )
    return o, lse


# Wide band tiles (`deberta_fwd_wide.py`): WIDE_M = 2 * WIDE_N query rows, one warpgroup's wgmma,
# for batches whose 32-row tiles would be full (max_seqlen > WIDE_N) and head dims <= 64. H200,
# fp16, H=12, K=64, device ms at cd8b556 (benchmarks/NOTES.md): doc1k batch 0 0.184 vs 0.267 for
# 32 x 32 tiles, doc1k 64k pack 2.25 vs 3.63, 8192 tokens 1.30 vs 2.11.
WIDE_TILES = True
WIDE_M, WIDE_N = 64, 32
# 4 warps, 1 stage (2 stages: pack 4.14 vs 3.48 ms at 14a3e8c), register cap 168: 3 programs per SM
# instead of 2 (pack 2.57 vs 2.55 uncapped, 8192 tokens 1.38 vs 1.53). p2c as two (WIDE_M, WIDE_N)
# wgmma GEMMs (WIDE_P2C) beats three (WIDE_N, WIDE_N) mma.sync chunks (pack 3.28 vs 3.66 ms at
# d1e509d) though they compute 128 slot rows for 95 distances.
WIDE_WARPS, WIDE_STAGES, WIDE_MAXNREG, WIDE_P2C = 4, 1, 168, True
# Key rows of a saturated (64, WIDE_NS) tile: 64 (pack 2.57 ms) vs 32 (2.51, but 8192 tokens 1.58 vs
# 1.38) and 128 (2.68). WIDE_POS_LOWP: c2p + p2c summed in the input dtype before they join q @ k^T,
# as HF's eager sums them (half the bytes of that layout conversion; one more rounding): pack 2.25
# vs 2.57 ms, doc1k encode 1.39x vs 1.32x DisentangledFlash; the GPU tests' HF-eager error rule holds.
WIDE_NS, WIDE_POS_LOWP = 64, True


def _launch_wide(q, k, v, cu_seqlens, order, has_order, max_seqlen, pk, pq, table, bounds, scale, c2p, p2c,
                 store_lse, o, lse_arg):
    """`launch_fwd` on (WIDE_M, WIDE_N) band tiles (lse_arg: the (T, H) lse, or any pointer without store_lse)."""
    T, H, Kd = q.shape
    for cu, n_seq in seq_chunks(cu_seqlens):
        _wide._fwd_wide_kernel[(cdiv(max_seqlen, WIDE_M), H, n_seq)](
            q, k, v, pk, pq, table[0], cu, order, o, lse_arg,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            pk.stride(0), pk.stride(1), pq.stride(0), pq.stride(1), o.stride(0), o.stride(1), H,
            table[1], *bounds, scale * LOG2E,
            HEAD_DIM=Kd, BLOCK_K=max(16, next_pow2(Kd)), BLOCK_M=WIDE_M, BLOCK_N=WIDE_N,
            NS=WIDE_NS,
            C2P=c2p, P2C=p2c, STORE_LSE=store_lse, PREC=_prec(q.dtype),
            LOWP=LOWP_GATHER and q.dtype != torch.float32, P2C_WIDE=WIDE_P2C,
            POS_LOWP=WIDE_POS_LOWP and LOWP_GATHER and q.dtype != torch.float32, HAS_ORDER=has_order,
            num_warps=WIDE_WARPS, num_stages=WIDE_STAGES, **register_cap(WIDE_MAXNREG),
        )


# ---- registered ops (CPU: the reference; CUDA: the kernels) ------------------------------------


@torch.library.custom_op("packedenc::deberta_attention", mutates_args=(), device_types="cpu")
def _deberta_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, pos_key: Tensor | None,
    pos_query: Tensor | None, position_buckets: int, max_relative_positions: int, scale: float,
    seq_order: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    types = tuple(t for t, x in (("c2p", pos_key), ("p2c", pos_query)) if x is not None)
    o = reference.deberta_attention(q, k, v, cu_seqlens, max_seqlen, pos_key, pos_query, pos_att_type=types,
                                    position_buckets=position_buckets, max_relative_positions=max_relative_positions,
                                    scale=scale)
    lse = _bwd.reference_lse(q, k, cu_seqlens, max_seqlen, pos_key, pos_query, position_buckets,
                             max_relative_positions, scale)
    return o.contiguous(), lse


@_deberta_attention.register_kernel("cuda")
def _(q, k, v, cu_seqlens, max_seqlen, pos_key, pos_query, position_buckets, max_relative_positions, scale,
      seq_order=None):
    return deberta_attention_fwd(q, k, v, cu_seqlens, max_seqlen, pos_key, pos_query, position_buckets,
                                 max_relative_positions, scale, seq_order=seq_order)


@_deberta_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, pos_key, pos_query, position_buckets, max_relative_positions, scale,
      seq_order=None):
    T, H, K = q.shape
    return q.new_empty((T, H, K)), q.new_empty((T, H), dtype=torch.float32)


# The backward op returns empty (0,) tensors for absent tables: custom ops cannot return None.
@torch.library.custom_op("packedenc::deberta_attention_bwd", mutates_args=(), device_types="cpu")
def _deberta_attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_seqlens: Tensor, max_seqlen: int,
    pos_key: Tensor | None, pos_query: Tensor | None, position_buckets: int, max_relative_positions: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = _bwd.reference_bwd(do, q, k, v, cu_seqlens, max_seqlen, pos_key, pos_query, position_buckets,
                               max_relative_positions, scale)
    return tuple(g if g is not None else q.new_empty((0,)) for g in grads)


@_deberta_attention_bwd.register_kernel("cuda")
def _(do, q, k, v, o, lse, cu_seqlens, max_seqlen, pos_key, pos_query, position_buckets, max_relative_positions,
      scale):
    grads = _bwd.deberta_attention_bwd(do, q, k, v, o, lse, cu_seqlens, max_seqlen, pos_key, pos_query,
                                       position_buckets, max_relative_positions, scale)
    return tuple(g if g is not None else q.new_empty((0,)) for g in grads)


@_deberta_attention_bwd.register_fake
def _(do, q, k, v, o, lse, cu_seqlens, max_seqlen, pos_key, pos_query, position_buckets, max_relative_positions,
      scale):
    T, H, K = q.shape
    tables = (t.new_empty(t.shape) if t is not None else q.new_empty((0,)) for t in (pos_key, pos_query))
    return (q.new_empty((T, H, K)), q.new_empty((T, H, K)), q.new_empty((T, H, K)), *tables)


def _setup(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, pos_key, pos_query, buckets, max_rel, scale, _ = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens, pos_key, pos_query)
    ctx.args = (max_seqlen, buckets, max_rel, scale)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, cu_seqlens, pos_key, pos_query = ctx.saved_tensors
    max_seqlen, buckets, max_rel, scale = ctx.args
    dq, dk, dv, dpk, dpq = torch.ops.packedenc.deberta_attention_bwd(
        do, q, k, v, o, lse, cu_seqlens, max_seqlen, pos_key, pos_query, buckets, max_rel, scale)
    return (dq, dk, dv, None, None, dpk if pos_key is not None else None, dpq if pos_query is not None else None,
            None, None, None, None)


_deberta_attention.register_autograd(_backward, setup_context=_setup)


# ---- the Ops-table entry: the reference signature ----------------------------------------------


def deberta_attention(
    q_THK: Tensor,
    k_THK: Tensor,
    v_THK: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    pos_key_RHK: Tensor | None = None,
    pos_query_RHK: Tensor | None = None,
    *,
    pos_att_type: tuple[str, ...] = (),
    position_buckets: int = -1,
    max_relative_positions: int = -1,
    scale: float,
    seq_order: Tensor | None = None,
) -> Tensor:
    """DeBERTa disentangled attention inside each packed sequence; see `reference.deberta_attention`.

    Arguments:
        q_THK, k_THK, v_THK: (T, H, K) with the head dim contiguous (views of the fused qkv are fine).
        cu_seqlens: (S+1,) int32. max_seqlen: host int >= the longest sequence.
        pos_key_RHK / pos_query_RHK: (R, H, K) c2p / p2c tables, present iff the term is in pos_att_type.
        position_buckets, max_relative_positions, scale: as in the reference.
        seq_order: (S,) int32 permutation from `packing.longest_first(cu_seqlens)`, or None: the
            programs take the sequences in this order (the result does not depend on it). Longest
            first shortens a ragged batch's last wave (H200, doc1k: benchmarks/NOTES.md).
    Return:
        (T, H, K) contiguous in q's dtype; fp32 scores and softmax, one rounding. Differentiable in
        q, k, v and both tables (Triton backward on CUDA; dPK / dPQ are fp32 atomics, see
        `deberta_attention_bwd.py`).
    """
    c2p, p2c = "c2p" in pos_att_type, "p2c" in pos_att_type
    assert (pos_key_RHK is not None) == c2p and (pos_query_RHK is not None) == p2c, pos_att_type
    check_seq_order(seq_order, cu_seqlens)
    args = (q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, pos_key_RHK, pos_query_RHK, position_buckets,
            max_relative_positions, scale)
    if direct_launch(q_THK, k_THK, v_THK, pos_key_RHK, pos_query_RHK):
        return deberta_attention_fwd(*args, store_lse=False, seq_order=seq_order)[0]
    return torch.ops.packedenc.deberta_attention(*args, seq_order)[0]


# Imported last: the backward module reads this module's helpers at import.
from packedenc.kernels.triton import deberta_attention_bwd as _bwd  # noqa: E402
from packedenc.kernels.triton import deberta_fwd_wide as _wide  # noqa: E402
