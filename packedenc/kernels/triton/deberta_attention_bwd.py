"""Backward of the packed DeBERTa disentangled attention: the two-kernel path, the launcher and the plain-torch spec.

Shapes: T packed tokens, S sequences, H heads, K head dim, R position-table rows, L max_seqlen,
M = N = BLOCK tile rows, W = 2 * BLOCK band distances (see `deberta_attention.py`).

With P the softmax, G = P * (dO V^T - rowsum(dO * O)) * scale the gradient of the unscaled score
q_i.k_j + q_i.PK[slot(i - j)] + k_j.PQ[slot(i - j)]:
    dq_i = sum_j G_ij (k_j + PK[slot])         dk_j = sum_i G_ij (q_i + PQ[slot])       dv = P^T dO
    dPK[r] = sum_{slot(i - j) = r} G_ij q_i    dPQ[r] = sum_{slot(i - j) = r} G_ij k_j
FA2's split: `_bwd_dkdv_kernel` (one program per key block, looping over query blocks) writes dk,
dv and dPQ; `_bwd_dq_kernel` (one program per query block) writes dq and dPK. Both recompute the
tile scores exactly as the forward (same band GEMMs, same slot lookups) and re-exponentiate with
the forward's log-sum-exp. The band terms are the transposes of the forward's picks: a `tl.gather`
scatters G into (M, W) / (W, N) band layout, one GEMM with the gathered table rows gives the
dq / dk part, another the per-distance table gradient, which is added to the fp32 dPK / dPQ at
its slot with `tl.atomic_add` (several distances share a slot, programs share slots; `sem="relaxed"`:
the adds need no ordering with other memory, and Triton's default acq_rel fences each one). Rank-1
tiles (one slot) add a row sum of G times the table row; their table gradient is summed in
registers over a run of tiles with the same slot and added once per run.

The launcher runs the one-pass kernel (`deberta_bwd_onepass.py`, `ONE_PASS = True`: one program
per key block recomputes each tile once, dq by fp32 atomics; 1.5x faster on an H200) unless
`ONE_PASS` is False, which gives this module's pair.

Determinism: dPK / dPQ are fp32 atomics summed in whatever order the programs finish, so they vary
in the last bits from run to run; so does dq on the one-pass path. With the pair, dq, dk, dv are
bitwise reproducible. Under `torch.use_deterministic_algorithms(True)` an atomic path raises (warns
with warn_only=True), as torch's own atomic kernels do.

`reference_bwd` is the same gradient written out in plain torch on the padded grid: the CPU
implementation of the registered backward op and the spec the kernels are tested against.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl
from torch import Tensor

from packedenc.kernels import reference
from packedenc.kernels.triton import deberta_attention as _fwd
from packedenc.kernels.triton._common import cdiv, next_pow2
from packedenc.kernels.triton.deberta_attention import (
    LOG2E, _key_block, _prec, _query_rows, _sequence_span, block_size, check_inputs, register_cap, seq_chunks,
    slot_table,
)
from packedenc.kernels.triton.deberta_scores import _pos_scores
from packedenc.kernels.triton.deberta_slots import _slot

__all__ = ["deberta_attention_bwd", "reference_bwd"]


# ---- plain-torch spec --------------------------------------------------------------------------


def _grids(cu_seqlens: Tensor, T: int, L: int):
    from packedenc.packing import positions_from_cu_seqlens, segment_ids

    seq_T, pos_T = segment_ids(cu_seqlens, T), positions_from_cu_seqlens(cu_seqlens, T)
    S = cu_seqlens.numel() - 1

    def grid(x_THK: Tensor) -> Tensor:  # (T, H, K) -> (S, H, L, K) fp32, zeros at pads
        g = x_THK.new_zeros((S, L, *x_THK.shape[1:]), dtype=torch.float32)
        return g.index_put((seq_T, pos_T), x_THK.float()).transpose(1, 2)

    def packed(x_SHLK: Tensor) -> Tensor:
        return x_SHLK.transpose(1, 2)[seq_T, pos_T]

    lengths_S = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    key_ok_SL = torch.arange(L, device=cu_seqlens.device)[None, :] < lengths_S[:, None]
    return grid, packed, key_ok_SL


def reference_scores(q, k, cu_seqlens, max_seqlen, pk, pq, position_buckets, max_relative_positions):
    """(S, H, L, L) fp32 unscaled scores on the padded grid, key pads -inf, and the (L, L) slots."""
    T, L = q.shape[0], max_seqlen
    grid, _, key_ok = _grids(cu_seqlens, T, L)
    qg, kg = grid(q), grid(k)
    s = qg @ kg.transpose(-1, -2)
    slot = None
    if pk is not None or pq is not None:
        R = (pk if pk is not None else pq).shape[0]
        rel = reference.relative_positions(L, position_buckets, max_relative_positions, q.device)
        slot = torch.clamp(rel + R // 2, 0, R - 1)
        idx = slot.expand(*s.shape)
        if pk is not None:
            s = s + torch.gather(torch.einsum("shik,rhk->shir", qg, pk.float()), -1, idx)
        if pq is not None:  # key j reads PQ at slot(i - j): gather along j's rows, then transpose
            s = s + torch.gather(torch.einsum("shjk,rhk->shjr", kg, pq.float()), -1, idx.transpose(-1, -2)
                                 ).transpose(-1, -2)
    # Padded query rows see every column (no all -inf row); their gradient is zero anyway.
    ok = key_ok[:, None, :] | ~key_ok[:, :, None]
    return s.masked_fill(~ok[:, None], float("-inf")), slot


def reference_lse(q, k, cu_seqlens, max_seqlen, pk, pq, position_buckets, max_relative_positions, scale):
    """(T, H) fp32 log2-sum-exp2 of scale * log2(e) * scores, the forward kernel's LSE output."""
    s, _ = reference_scores(q, k, cu_seqlens, max_seqlen, pk, pq, position_buckets, max_relative_positions)
    lse = torch.logsumexp(s * scale, -1) * LOG2E  # (S, H, L)
    return _grids(cu_seqlens, q.shape[0], max_seqlen)[1](lse[..., None])[..., 0].contiguous()


def reference_bwd(do, q, k, v, cu_seqlens, max_seqlen, pk, pq, position_buckets, max_relative_positions,
                  scale):
    """(dq, dk, dv, dpk, dpq) of `reference.deberta_attention` (None for an absent table).

    Explicit formulas, fp32, on the padded (S, H, L, L) grid: O(S L^2) memory, for CPU and tests.
    """
    T, L = q.shape[0], max_seqlen
    grid, packed, _ = _grids(cu_seqlens, T, L)
    s, slot = reference_scores(q, k, cu_seqlens, max_seqlen, pk, pq, position_buckets, max_relative_positions)
    p = torch.softmax(s * scale, -1)
    qg, kg, vg, dog = grid(q), grid(k), grid(v), grid(do)
    dp = dog @ vg.transpose(-1, -2)
    g = p * (dp - (p * dp).sum(-1, keepdim=True)) * scale
    dq, dk, dv = g @ kg, g.transpose(-1, -2) @ qg, p.transpose(-1, -2) @ dog
    dpk = dpq = None
    if pk is not None:  # per query row, G summed over the keys sharing a slot
        gc = torch.zeros(*g.shape[:-1], pk.shape[0], dtype=g.dtype, device=g.device)
        gc.scatter_add_(-1, slot.expand(*g.shape), g)
        dq = dq + torch.einsum("shir,rhk->shik", gc, pk.float())
        dpk = torch.einsum("shir,shik->rhk", gc, qg).to(pk.dtype)
    if pq is not None:  # per key row j, G summed over the queries sharing a slot
        gp = torch.zeros(*g.shape[:-1], pq.shape[0], dtype=g.dtype, device=g.device)
        gp.scatter_add_(-1, slot.transpose(-1, -2).expand(*g.shape), g.transpose(-1, -2))
        dk = dk + torch.einsum("shjr,rhk->shjk", gp, pq.float())
        dpq = torch.einsum("shjr,shjk->rhk", gp, kg).to(pq.dtype)
    dq, dk, dv = (packed(t).to(q.dtype).contiguous() for t in (dq, dk, dv))
    return dq, dk, dv, dpk, dpq


# ---- kernels -----------------------------------------------------------------------------------


@triton.jit
def _query_block(Q, DO, LSE, DELTA, start, i0, L, hh, s_q_t, s_q_h, s_do_t, s_do_h, s_lse_t, offs, offs_k, kmask):
    """Rows i0 .. i0 + B - 1 of a sequence at `start`: (token rows, row mask, (B, K) mask, q, dO, LSE, delta)."""
    rows, mmask, q = _query_rows(Q, start, i0, L, hh, s_q_t, s_q_h, offs, offs_k, kmask)
    qmask = mmask[:, None] & kmask[None, :]
    do = tl.load(DO + rows[:, None] * s_do_t + hh * s_do_h + offs_k[None, :], mask=qmask, other=0.0)
    lse = tl.load(LSE + rows * s_lse_t + hh, mask=mmask, other=0.0)
    delta = tl.load(DELTA + rows * s_lse_t + hh, mask=mmask, other=0.0)
    return rows, mmask, qmask, q, do, lse, delta


@triton.jit
def _probs_and_grad(q, k, v, do, lse, delta, PKh, PQh, SLOT, i0, j0, half, hh, s_pk_r, s_pq_r,
                    offs_k, kmask, idx, valid, qk_scale, scale,
                    C2P: tl.constexpr, P2C: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr,
                    LOWP: tl.constexpr):
    """(P, G) of a tile in fp32: the forward's probabilities and the score gradient, 0 off `valid`."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if C2P or P2C:
        s = _pos_scores(s, q, k, PKh, PQh, SLOT, i0, j0, half, hh, s_pk_r, s_pq_r, offs_k, kmask, idx,
                        C2P, P2C, BLOCK, PREC, LOWP)
    p = tl.where(valid, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    return p, p * (dp - delta[:, None]) * scale


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, PK, PQ, SLOT, CU,  # as in the forward
    DO, LSE, DELTA,  # (T, H, K) output gradient; (T, H) fp32 forward LSE; (T, H) fp32 rowsum(dO * O)
    DQ,  # (T, H, K) out, q's dtype
    DPK,  # (R, H, K) fp32, zero-initialised, atomically accumulated (C2P)
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_pk_r, s_pk_h, s_pq_r, s_pq_h,
    s_do_t, s_do_h, s_dq_t, s_dq_h, s_lse_t, s_dpk_r, s_dpk_h,
    half, qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
    C2P: tl.constexpr, P2C: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
):
    pid_m, h = tl.program_id(0), tl.program_id(1)
    start, L = _sequence_span(CU, CU, False)
    i0 = pid_m * BLOCK
    if i0 >= L:
        return
    hh = h.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < HEAD_DIM
    rows, mmask, qmask, q, do, lse, delta = _query_block(Q, DO, LSE, DELTA, start, i0, L, hh, s_q_t, s_q_h,
                                                         s_do_t, s_do_h, s_lse_t, offs, offs_k, kmask)
    idx = offs[:, None] - offs[None, :] + (BLOCK - 1)
    w = tl.arange(0, 2 * BLOCK)
    PKh, PQh = PK + hh * s_pk_h, PQ + hh * s_pq_h
    DPKh = DPK + hh * s_dpk_h

    dq = tl.zeros([BLOCK, BLOCK_K], tl.float32)
    run_slot = tl.zeros([], tl.int32) - 1  # slot of the current run of rank-1 tiles
    run_g = tl.zeros([BLOCK], tl.float32)  # its per-row sum of G
    for j0 in range(0, L, BLOCK):
        cols, nmask, kv_mask, k, v = _key_block(K, V, start, j0, L, hh, s_k_t, s_k_h, s_v_t, s_v_h, offs, offs_k, kmask)
        p, g = _probs_and_grad(q, k, v, do, lse, delta, PKh, PQh, SLOT, i0, j0, half, hh, s_pk_r, s_pq_r,
                               offs_k, kmask, idx, mmask[:, None] & nmask[None, :], qk_scale, scale,
                               C2P, P2C, BLOCK, PREC, LOWP)
        dq += tl.dot(g.to(k.dtype), k, input_precision=PREC)
        if C2P:
            d0 = i0 - j0 - (BLOCK - 1)
            slot_lo = _slot(SLOT, d0, half)
            if slot_lo == _slot(SLOT, d0 + 2 * BLOCK - 2, half):
                g_m = tl.sum(g, 1)
                pk = tl.load(PKh + slot_lo.to(tl.int64) * s_pk_r + offs_k, mask=kmask, other=0.0).to(tl.float32)
                dq += g_m[:, None] * pk[None, :]
                if slot_lo != run_slot:
                    if run_slot >= 0:
                        tl.atomic_add(DPKh + run_slot.to(tl.int64) * s_dpk_r + offs_k,
                                      tl.sum(q.to(tl.float32) * run_g[:, None], 0), mask=kmask, sem="relaxed")
                    run_g = tl.zeros([BLOCK], tl.float32)
                    run_slot = slot_lo
                run_g += g_m
            else:
                # formed here, not held across the loop (registers: see deberta_bwd_onepass.py)
                band_n = offs[:, None] - w[None, :] + (BLOCK - 1)  # (M, W): key column n of (m, w)
                band_ok = (band_n >= 0) & (band_n < BLOCK)
                band_n = tl.minimum(tl.maximum(band_n, 0), BLOCK - 1)
                slot_w = _slot(SLOT, d0 + w, half).to(tl.int64)
                pkw = tl.load(PKh + slot_w[:, None] * s_pk_r + offs_k[None, :], mask=kmask[None, :], other=0.0)
                gc = tl.where(band_ok, tl.gather(g.to(q.dtype), band_n, axis=1), 0.0)  # (M, W)
                dq += tl.dot(gc, pkw.to(q.dtype), input_precision=PREC)
                dpkw = tl.dot(tl.trans(gc), q, input_precision=PREC)  # (W, K)
                tl.atomic_add(DPKh + slot_w[:, None] * s_dpk_r + offs_k[None, :], dpkw, mask=kmask[None, :],
                              sem="relaxed")
    if C2P:
        if run_slot >= 0:
            tl.atomic_add(DPKh + run_slot.to(tl.int64) * s_dpk_r + offs_k,
                          tl.sum(q.to(tl.float32) * run_g[:, None], 0), mask=kmask, sem="relaxed")
    tl.store(DQ + rows[:, None] * s_dq_t + hh * s_dq_h + offs_k[None, :], dq.to(DQ.dtype.element_ty), mask=qmask)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, PK, PQ, SLOT, CU, DO, LSE, DELTA,  # as in `_bwd_dq_kernel`
    DK, DV,  # (T, H, K) out (same strides), q's dtype
    DPQ,  # (R, H, K) fp32, zero-initialised, atomically accumulated (P2C)
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_pk_r, s_pk_h, s_pq_r, s_pq_h,
    s_do_t, s_do_h, s_dk_t, s_dk_h, s_lse_t, s_dpq_r, s_dpq_h,
    half, qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
    C2P: tl.constexpr, P2C: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
):
    pid_n, h = tl.program_id(0), tl.program_id(1)
    start, L = _sequence_span(CU, CU, False)
    j0 = pid_n * BLOCK
    if j0 >= L:
        return
    hh = h.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < HEAD_DIM
    cols, nmask, kv_mask, k, v = _key_block(K, V, start, j0, L, hh, s_k_t, s_k_h, s_v_t, s_v_h, offs, offs_k, kmask)
    idx = offs[:, None] - offs[None, :] + (BLOCK - 1)
    w = tl.arange(0, 2 * BLOCK)
    PKh, PQh = PK + hh * s_pk_h, PQ + hh * s_pq_h
    DPQh = DPQ + hh * s_dpq_h

    dk = tl.zeros([BLOCK, BLOCK_K], tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_K], tl.float32)
    run_slot = tl.zeros([], tl.int32) - 1
    run_g = tl.zeros([BLOCK], tl.float32)  # per-key sum of G over the current rank-1 run
    for i0 in range(0, L, BLOCK):
        rows, mmask, qmask, q, do, lse, delta = _query_block(Q, DO, LSE, DELTA, start, i0, L, hh, s_q_t, s_q_h,
                                                             s_do_t, s_do_h, s_lse_t, offs, offs_k, kmask)
        p, g = _probs_and_grad(q, k, v, do, lse, delta, PKh, PQh, SLOT, i0, j0, half, hh, s_pk_r, s_pq_r,
                               offs_k, kmask, idx, mmask[:, None] & nmask[None, :], qk_scale, scale,
                               C2P, P2C, BLOCK, PREC, LOWP)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
        dk += tl.dot(tl.trans(g.to(q.dtype)), q, input_precision=PREC)
        if P2C:
            d0 = i0 - j0 - (BLOCK - 1)
            slot_lo = _slot(SLOT, d0, half)
            if slot_lo == _slot(SLOT, d0 + 2 * BLOCK - 2, half):
                g_n = tl.sum(g, 0)
                pq = tl.load(PQh + slot_lo.to(tl.int64) * s_pq_r + offs_k, mask=kmask, other=0.0).to(tl.float32)
                dk += g_n[:, None] * pq[None, :]
                if slot_lo != run_slot:
                    if run_slot >= 0:
                        tl.atomic_add(DPQh + run_slot.to(tl.int64) * s_dpq_r + offs_k,
                                      tl.sum(k.to(tl.float32) * run_g[:, None], 0), mask=kmask, sem="relaxed")
                    run_g = tl.zeros([BLOCK], tl.float32)
                    run_slot = slot_lo
                run_g += g_n
            else:
                band_m = w[:, None] + offs[None, :] - (BLOCK - 1)  # (W, N): query row m of (w, n)
                band_ok = (band_m >= 0) & (band_m < BLOCK)
                band_m = tl.minimum(tl.maximum(band_m, 0), BLOCK - 1)
                slot_w = _slot(SLOT, d0 + w, half).to(tl.int64)
                pqw = tl.load(PQh + slot_w[:, None] * s_pq_r + offs_k[None, :], mask=kmask[None, :], other=0.0)
                gp = tl.where(band_ok, tl.gather(g.to(k.dtype), band_m, axis=0), 0.0)  # (W, N)
                dk += tl.dot(tl.trans(gp), pqw.to(k.dtype), input_precision=PREC)
                dpqw = tl.dot(gp, k, input_precision=PREC)  # (W, K)
                tl.atomic_add(DPQh + slot_w[:, None] * s_dpq_r + offs_k[None, :], dpqw, mask=kmask[None, :],
                              sem="relaxed")
    if P2C:
        if run_slot >= 0:
            tl.atomic_add(DPQh + run_slot.to(tl.int64) * s_dpq_r + offs_k,
                          tl.sum(k.to(tl.float32) * run_g[:, None], 0), mask=kmask, sem="relaxed")
    tl.store(DK + cols[:, None] * s_dk_t + hh * s_dk_h + offs_k[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + cols[:, None] * s_dk_t + hh * s_dk_h + offs_k[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


# ---- launcher ----------------------------------------------------------------------------------

BLOCK_MAX_BWD = 32  # tile rows (sm_90 compile: 32-row tiles, 8 warps spill <= 184 bytes at K = 128)
NUM_WARPS_BWD = 4  # H200: 4 warps 1.3-1.7x faster than 8 at K = 64 despite <= 200 bytes of dK/dV spills;
# K = 128 keeps 8 (4 would spill ~1 KB per thread)
NUM_STAGES_BWD = 3  # H200: ~2% faster than 2
# One kernel that recomputes each tile once (`deberta_bwd_onepass.py`; dq by fp32 atomics) instead
# of the dq + dk/dv pair that recomputes it twice. H200, 64k-token doc1k pack, K = 64
# (`profile_gpu --parts kernel`, 582806b): 11.7 ms (4 warps, 1 stage) vs 17.5 for the pair;
# one 8192-token sequence 11.1 vs 18.3.
ONE_PASS = True
NUM_WARPS_ONEPASS = 4  # sm_90 ptxas spills ~360 bytes a thread on 4 warps; 8 warps: 17.5 ms
NUM_STAGES_ONEPASS = 1  # 3 stages: 13.9 ms, 2: 13.8 (the pipelined loads compete with the spills)
# Register caps (`deberta_attention.MAXNREG`): at 255 registers the one-pass kernel runs 2 programs
# per SM. H200 at 22adb5c: a 168 cap is faster on one 8192-token sequence (10.1 vs 10.9 ms) but
# slower on the doc1k batches that training runs (64k pack 12.5 vs 12.0 ms, a batch 1.09 vs 0.97).
MAXNREG_BWD: int | None = None
MAXNREG_ONEPASS: int | None = None


def _alert_not_deterministic() -> None:
    """fp32 atomic sums (module docstring): an error under torch.use_deterministic_algorithms(True),
    a warning with warn_only=True, as torch's own atomic-based CUDA kernels do."""
    if torch.are_deterministic_algorithms_enabled():
        msg = ("packedenc DeBERTa attention backward sums with fp32 atomics and is not deterministic "
               "(only the pair path, deberta_attention_bwd.ONE_PASS = False, without position tables is)")
        if not torch.is_deterministic_algorithms_warn_only_enabled():
            raise RuntimeError(msg)
        warnings.warn(msg, stacklevel=3)


def deberta_attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_seqlens: Tensor, max_seqlen: int,
    pos_key: Tensor | None, pos_query: Tensor | None, position_buckets: int, max_relative_positions: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Launch the backward. Return (dq, dk, dv) contiguous in q's dtype, dpk / dpq in the tables' dtypes.

    `o` and `lse` are the forward's outputs (lse from `deberta_attention_fwd(store_lse=True)`).
    """
    check_inputs(q, k, v, cu_seqlens, pos_key, pos_query)
    if ONE_PASS or pos_key is not None or pos_query is not None:
        _alert_not_deterministic()
    T, H, Kd = q.shape
    S = cu_seqlens.numel() - 1
    do = do if do.stride(-1) == 1 else do.contiguous()
    dq, dk, dv = (torch.empty((T, H, Kd), dtype=q.dtype, device=q.device) for _ in range(3))
    dpk = torch.zeros(pos_key.shape, dtype=torch.float32, device=q.device) if pos_key is not None else None
    dpq = torch.zeros(pos_query.shape, dtype=torch.float32, device=q.device) if pos_query is not None else None
    if T and S and max_seqlen > 0:
        delta = (do.float() * o.float()).sum(-1)  # (T, H): rowsum(dO * O), FA's preprocessing
        lse = lse.contiguous()
        pos = pos_key if pos_key is not None else pos_query
        R = pos.shape[0] if pos is not None else 2  # any table when there is no position term
        table, half = slot_table(position_buckets, max_relative_positions, R, max_seqlen, q.device)
        pk = pos_key if pos_key is not None else q
        pq = pos_query if pos_query is not None else q
        BLOCK_K = max(16, next_pow2(Kd))
        BLOCK = min(block_size(max_seqlen), BLOCK_MAX_BWD)
        common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                  pk.stride(0), pk.stride(1), pq.stride(0), pq.stride(1), do.stride(0), do.stride(1))
        meta = dict(HEAD_DIM=Kd, BLOCK_K=BLOCK_K, BLOCK=BLOCK, C2P=pos_key is not None, P2C=pos_query is not None,
                    PREC=_prec(q.dtype), LOWP=_fwd.LOWP_GATHER and q.dtype != torch.float32,
                    num_warps=NUM_WARPS_BWD if BLOCK > 16 and Kd <= 64 else 4 if BLOCK <= 16 else 8,
                    num_stages=NUM_STAGES_BWD)
        dpk_ = dpk if dpk is not None else delta  # any fp32 pointer when the table is absent
        dpq_ = dpq if dpq is not None else delta
        if ONE_PASS:
            dq32 = torch.zeros((T, H, Kd), dtype=torch.float32, device=q.device)
            for cu, n_seq in seq_chunks(cu_seqlens):
                _bwd_onepass_kernel[(cdiv(max_seqlen, BLOCK), H, n_seq)](
                    q, k, v, pk, pq, table, cu, do, lse, delta, dq32, dk, dv, dpk_, dpq_,
                    *common, dq32.stride(0), dq32.stride(1), dk.stride(0), dk.stride(1), lse.stride(0),
                    dpk_.stride(0), dpk_.stride(-2), dpq_.stride(0), dpq_.stride(-2),
                    half, scale * LOG2E, scale,
                    **{**meta, "num_warps": 4 if BLOCK <= 16 else NUM_WARPS_ONEPASS if Kd <= 64 else 8,
                       "num_stages": NUM_STAGES_ONEPASS, **register_cap(MAXNREG_ONEPASS)},
                )
            dq.copy_(dq32)
        else:
            for cu, n_seq in seq_chunks(cu_seqlens):
                grid = (cdiv(max_seqlen, BLOCK), H, n_seq)
                _bwd_dq_kernel[grid](
                    q, k, v, pk, pq, table, cu, do, lse, delta, dq, dpk_,
                    *common, dq.stride(0), dq.stride(1), lse.stride(0), dpk_.stride(0), dpk_.stride(-2),
                    half, scale * LOG2E, scale, **meta, **register_cap(MAXNREG_BWD),
                )
                _bwd_dkdv_kernel[grid](
                    q, k, v, pk, pq, table, cu, do, lse, delta, dk, dv, dpq_,
                    *common, dk.stride(0), dk.stride(1), lse.stride(0), dpq_.stride(0), dpq_.stride(-2),
                    half, scale * LOG2E, scale, **meta, **register_cap(MAXNREG_BWD),
                )
    else:
        for t in (dq, dk, dv):
            t.zero_()
    dpk = dpk.to(pos_key.dtype) if dpk is not None else None
    dpq = dpq.to(pos_query.dtype) if dpq is not None else None
    return dq, dk, dv, dpk, dpq


# Imported last: the one-pass kernel reuses this module's `_probs_and_grad`.
from packedenc.kernels.triton.deberta_bwd_onepass import _bwd_onepass_kernel  # noqa: E402
