"""Packed varlen attention in Triton: token-block tiles that short sequences share (the forward).

Shapes: T packed tokens, S sequences, H heads, K head dim, M = BLOCK_M query rows and
N = BLOCK_N key rows of a tile.

Three files: this one (the forward kernel, the span helper every pass shares, the tile table),
`attention_bwd.py` (the dQ and dK/dV kernels) and `attention_op.py` (the registered op, its
autograd and the Ops-table entries).

Why not FA2's layout: torch's FA2 varlen tiles each sequence on its own in 128-row blocks, so a
24-token query sequence pays for a 128 x 128 tile (80% wasted), and a (64, 64) window over
~350-token documents touches up to 3 x 128 = 384 keys per row. Here every grid runs over blocks
of *consecutive packed rows*, whatever sequence they belong to (`_spans`):
  - each row finds its sequence [start, end) by a binary search of cu_seqlens (S + 1 int32,
    L1/L2 resident; ceil(log2 S) steps), so nothing per token is precomputed, cached or synced;
  - query row i sees keys [max(start, i - left), min(end, i + right + 1)) (FA's inclusive window,
    -1 unbounded). Both bounds never decrease with i, so a block's keys are one contiguous range
    [lo of its first row, hi of its last row), looped over in N-row tiles from exactly that start
    (a 64-row block under a (64, 64) window reads M + 128 = 192 keys; a global block of a 24-token
    query pack reads the 2-4 sequences it straddles);
  - tiles that cross some row's bound are masked per row, which also keeps sequences apart (a row
    never mixes in a key of another sequence, for any tiling); tiles inside every row's range (the
    interior of a long sequence, the middle tile of a window) skip the compares.
  - the programs run heads fastest (`grid`): the H programs of one row block are neighbours in
    launch order, so the rows they read, one head's K elements each, are fetched together.
Attention inside a sequence is symmetric: key j is seen by the queries
[max(start, j - right), min(end, j + left + 1)) (the window mirrored), so the dK/dV pass runs the
same `_spans` over key-row blocks with left and right swapped.

`_fwd_kernel`: scores q k^T by tl.dot (bf16/fp16 inputs, fp32 accumulate; exact fp32 for fp32
inputs), online softmax in fp32 with exp2 and scale * log2(e) folded into one multiply, P rounded
to v's dtype for P V (as FA2), one rounding of the output; with STORE_LSE it also writes each
row's log2-sum-exp2 LSE2 (H, T) fp32, which the backward reads instead of recomputing the softmax
statistics. Rows whose running max is still -inf (their keys start in a later tile) use 0 as the
shift, so exp2 gives exact zeros rather than NaN.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from packedenc.kernels import reference
from packedenc.kernels.triton._common import cdiv, launch, next_pow2

__all__ = ["attention_fwd", "tiles", "bwd_tiles", "descriptors", "LOG2E", "MAX_HEAD_DIM"]

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


@triton.jit
def _spans(CU, rows, T, S, n_steps, lo_w, hi_w, LO_W: tl.constexpr, HI_W: tl.constexpr,
           BLOCK: tl.constexpr, BLOCK_IN: tl.constexpr):
    """What each of the BLOCK packed `rows` a program owns sees on the other side.

    Row r of sequence [start, end) sees [a_r, b_r) = [max(start, r - lo_w), min(end, r + hi_w + 1))
    (bounds applied only when LO_W / HI_W). Return (in_t: row < T, valid: row < cu[S], a, b,
    blk_lo, mid_lo, mid_hi, blk_hi): the block loops over [blk_lo, blk_hi) in BLOCK_IN tiles from
    blk_lo; those in [mid_lo, mid_hi) lie inside every valid row's range (no per-element mask).
    The caller forms `rows` (pid * BLOCK + arange) and addresses its stores with it: torch.compile's
    analysis of which arguments a kernel writes runs before Triton inlines, takes a call's results
    as depending on all its arguments, and would count CU as written were the rows returned here.
    """
    in_t = rows < T
    r = tl.minimum(rows, T - 1)
    # The largest s with cu[s] <= r (invariant cu[lo] <= r < cu[hi]; empty sequences are skipped).
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.zeros([BLOCK], tl.int32) + S
    for _ in range(n_steps):
        mid = (lo + hi) >> 1
        go = tl.load(CU + mid) <= r
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    a = tl.load(CU + lo)
    end = tl.load(CU + hi)
    b = end
    if LO_W:
        a = tl.maximum(a, rows - lo_w)
    if HI_W:
        b = tl.minimum(b, rows + hi_w + 1)
    valid = in_t & (rows < end)  # rows past cu[S] (if any) see nothing and get zeros
    b = tl.where(valid, b, a)
    blk_lo = tl.min(tl.where(valid, a, T), 0)
    blk_hi = tl.max(tl.where(valid, b, 0), 0)
    full_lo = tl.max(tl.where(valid, a, 0), 0)
    full_hi = tl.min(tl.where(valid, b, T), 0)
    mid_lo = blk_lo + tl.cdiv(tl.maximum(full_lo - blk_lo, 0), BLOCK_IN) * BLOCK_IN
    mid_hi = mid_lo + tl.maximum(full_hi - mid_lo, 0) // BLOCK_IN * BLOCK_IN
    return in_t, valid, a, b, blk_lo, mid_lo, mid_hi, blk_hi


@triton.jit
def _rope(x, x_partner, pos, CS, P, offs_k, inv, sgn, scaling, BLOCK_K: tl.constexpr):
    """x (rows, head dim) rotated by split-half RoPE, as `rotary.py` does: cos / sin of the fp32
    angle pos * inv_freq rounded to x's dtype, rotation in fp32, one rounding. `x_partner` is x
    with its halves swapped, `sgn` -1 on the first half and +1 on the second.

    cos / sin come from the table CS (P, 2, BLOCK_K) fp32 (`rope_table`: the same rounded values,
    sin signed) when every row's position is below P; otherwise they are computed here. The
    table is why the fused forward costs the GPU no more than the two ops it replaces: each key
    tile is rotated once per head and per query block that reads it, too many cos / sin for the
    SFU (the rotary kernel takes them once per token for all heads)."""
    if tl.max(pos, 0) < P:
        cs = CS + pos.to(tl.int64)[:, None] * (2 * BLOCK_K) + offs_k[None, :]
        c = tl.load(cs)
        s = tl.load(cs + BLOCK_K)
    else:
        ang = pos.to(tl.float32)[:, None] * inv[None, :]
        c = (tl.cos(ang) * scaling).to(x.dtype).to(tl.float32)
        s = (tl.sin(ang) * scaling).to(x.dtype).to(tl.float32) * sgn[None, :]
    return (x.to(tl.float32) * c + x_partner.to(tl.float32) * s).to(x.dtype)


@triton.jit
def _load_tiles(pa, pb, AD, BD, row0, col, inb, kmask, TMA: tl.constexpr, MASKED: tl.constexpr,
                EVEN_K: tl.constexpr):
    """Two (rows, BLOCK_K) tiles at pointers pa, pb, or through the descriptors AD, BD at
    [row0, col] (TMA: whole blocks, zeros past T); MASKED guards rows by `inb`, EVEN_K skips the
    head-dim mask. Every pass's loop reads its two tiles here."""
    if TMA:
        a = AD.load([row0, col])
        b = BD.load([row0, col])
    elif MASKED:
        m = inb[:, None] & kmask[None, :]
        a = tl.load(pa, mask=m, other=0.0)
        b = tl.load(pb, mask=m, other=0.0)
    elif EVEN_K:  # a full tile: no mask at all
        a = tl.load(pa)
        b = tl.load(pb)
    else:
        a = tl.load(pa, mask=kmask[None, :], other=0.0)
        b = tl.load(pb, mask=kmask[None, :], other=0.0)
    return a, b


@triton.jit
def _attend(acc, l_i, m_i, q, K, V, KD, VD, h, s_k_t, s_k_h, s_v_t, s_v_h, j_lo, j_hi, blk_hi, kl, kh, qk_scale,
            offs_n, offs_k, kmask, POS, CS, P, inv, sgn, partner, scaling,
            BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr,
            ROPE: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """Online softmax over key tiles j_lo, j_lo + N, ... < j_hi. MASKED: per-row ranges [kl, kh)
    and loads guarded at blk_hi; unmasked tiles lie inside every row's range (no compares).
    ROPE: each key tile is rotated as it is read (`_rope`; positions POS, table CS of P positions,
    per-column inv, sgn, partner columns). TMA: tiles come whole through the descriptors KD, VD
    ((T, H * K) views; rows past T read as zeros, rows of other sequences are masked in the scores)."""
    for j0 in range(j_lo, j_hi, BLOCK_N):
        cols = j0 + offs_n
        c64 = cols.to(tl.int64)[:, None]
        kp = K + c64 * s_k_t + h * s_k_h + offs_k[None, :]
        vp = V + c64 * s_v_t + h * s_v_h + offs_k[None, :]
        k, v = _load_tiles(kp, vp, KD, VD, j0, h.to(tl.int32) * BLOCK_K, cols < blk_hi, kmask, TMA, MASKED, EVEN_K)
        if ROPE:
            kpp = K + c64 * s_k_t + h * s_k_h + partner[None, :]
            if MASKED:
                k_partner = tl.load(kpp, mask=(cols < blk_hi)[:, None] & kmask[None, :], other=0.0)
                pos = tl.load(POS + cols, mask=cols < blk_hi, other=0)
            else:
                k_partner = tl.load(kpp, mask=kmask[None, :], other=0.0)
                pos = tl.load(POS + cols)
            k = _rope(k, k_partner, pos, CS, P, offs_k, inv, sgn, scaling, BLOCK_K)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        if MASKED:
            keep = (cols[None, :] >= kl[:, None]) & (cols[None, :] < kh[:, None])
            s = tl.where(keep, s, float("-inf"))
        # Running max in scaled units; qk_scale > 0, so max(s) * c = max(s * c) and one FMA
        # (s * c - shift) feeds exp2.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp2 -> exact 0, not NaN
        alpha = tl.exp2(m_i - shift)
        p = tl.exp2(s * qk_scale - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _program(HEAD_MAJOR: tl.constexpr):
    """(head as int64, row block) of this program: grid (blocks, H), or (H, blocks) when HEAD_MAJOR."""
    if HEAD_MAJOR:
        return tl.program_id(0).to(tl.int64), tl.program_id(1)
    return tl.program_id(1).to(tl.int64), tl.program_id(0)


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension


def grid(blocks: int, H: int, head_major: bool = True) -> tuple[tuple[int, int], bool]:
    """(launch grid, HEAD_MAJOR) for `blocks` row blocks of H heads. Heads fastest by default: a row
    block's H programs then run side by side and read the block's rows (H * K elements apart per
    head) at about the same time; measured faster or even on every workload, forward and backward
    (`benchmarks.attention_order_probe`, records in benchmarks/results/history). Blocks fastest
    when the blocks would pass CUDA's limit on the grid's second dimension."""
    if head_major and blocks <= MAX_GRID_Y:
        return (H, blocks), True
    return (blocks, H), False


@triton.jit(do_not_specialize=["T", "S", "n_steps", "left", "right"])
def _fwd_kernel(
    Q, K, V,  # (T, H, K) views, head dim contiguous (slices of a fused qkv buffer are fine)
    KD, VD,  # TMA: descriptors of K and V as (T, H * K), blocks (BLOCK_N, K); else K, V (unread)
    O,  # (T, H, K) out
    LSE,  # (H, T) fp32 out: log2-sum-exp2 of the scaled scores of each row (STORE_LSE)
    CU,  # (S + 1,) int32 cu_seqlens
    T, S, n_steps,  # tokens, sequences, binary-search steps (>= ceil(log2 S))
    left, right,  # window; read only when WINDOW_L / WINDOW_R
    qk_scale,  # scale * log2(e), > 0
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_o_t, s_o_h,  # strides in elements
    POS, INV_FREQ, CS, P, scaling,  # ROPE: (T,) int positions, (K/2,) fp32 inverse frequencies,
    # (P, 2, BLOCK_K) fp32 cos / signed sin table of positions < P, HF's attention_scaling
    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr,
    STORE_LSE: tl.constexpr,
    PREC: tl.constexpr,  # tl.dot input_precision ("ieee" for fp32 inputs)
    ROPE: tl.constexpr,  # rotate q and k (split-half RoPE) as they are read: inference only
    HEAD_MAJOR: tl.constexpr,  # grid (H, blocks): a block's heads run side by side (`grid`)
    TMA: tl.constexpr,  # key and value tiles through KD, VD (`_attend`)
):
    qk_scale, scaling = tl.cast(qk_scale, tl.float32), tl.cast(scaling, tl.float32)  # torch.compile passes fp64
    h, blk = _program(HEAD_MAJOR)
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)  # int32 packed row ids
    in_t, valid, kl, kh, blk_lo, mid_lo, mid_hi, blk_hi = _spans(
        CU, rows, T, S, n_steps, left, right, WINDOW_L, WINDOW_R, BLOCK_M, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < HEAD_DIM
    r64 = rows.to(tl.int64)[:, None]
    qmask = in_t[:, None] & kmask[None, :]
    q = tl.load(Q + r64 * s_q_t + h * s_q_h + offs_k[None, :], mask=qmask, other=0.0)
    # split-half RoPE: column d pairs with d -/+ K/2 (a no-op set of values when not ROPE)
    half = HEAD_DIM // 2
    first = offs_k < half
    partner = tl.where(first, offs_k + half, offs_k - half)
    sgn = tl.where(first, -1.0, 1.0)
    inv = tl.zeros([BLOCK_K], tl.float32)
    if ROPE:
        inv = tl.load(INV_FREQ + tl.where(first, offs_k, offs_k - half), mask=kmask, other=0.0)
        q_partner = tl.load(Q + r64 * s_q_t + h * s_q_h + partner[None, :], mask=qmask, other=0.0)
        q = _rope(q, q_partner, tl.load(POS + rows, mask=in_t, other=0), CS, P, offs_k, inv, sgn, scaling, BLOCK_K)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K, V, KD, VD, h, s_k_t, s_k_h, s_v_t, s_v_h, blk_lo, mid_lo, blk_hi,
                            kl, kh, qk_scale, offs_n, offs_k, kmask, POS, CS, P, inv, sgn, partner, scaling,
                            BLOCK_N, True, HEAD_DIM == BLOCK_K, PREC, ROPE, BLOCK_K, TMA)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K, V, KD, VD, h, s_k_t, s_k_h, s_v_t, s_v_h, mid_lo, mid_hi, blk_hi,
                            kl, kh, qk_scale, offs_n, offs_k, kmask, POS, CS, P, inv, sgn, partner, scaling,
                            BLOCK_N, False, HEAD_DIM == BLOCK_K, PREC, ROPE, BLOCK_K, TMA)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K, V, KD, VD, h, s_k_t, s_k_h, s_v_t, s_v_h, mid_hi, blk_hi, blk_hi,
                            kl, kh, qk_scale, offs_n, offs_k, kmask, POS, CS, P, inv, sgn, partner, scaling,
                            BLOCK_N, True, HEAD_DIM == BLOCK_K, PREC, ROPE, BLOCK_K, TMA)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # only invalid rows have no key
    out = tl.where(valid[:, None], acc / l_safe[:, None], 0.0)
    tl.store(O + r64 * s_o_t + h * s_o_h + offs_k[None, :], out.to(O.dtype.element_ty),
             mask=in_t[:, None] & kmask[None, :])
    if STORE_LSE:
        tl.store(LSE + h * T + rows, tl.where(valid, m_i + tl.log2(l_safe), 0.0), mask=in_t)


# ---- tiles ---------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages[, TMA]), from host values only; each row is (forward,
# dQ, dK/dV), where dQ tiles are (query rows owned, key tile) and dK/dV tiles (key rows owned,
# query tile). All from the sweeps at H=12, K=64 (`python -m benchmarks attention --sweep`, records
# in benchmarks/results/attention_h200.json): the backward of long and mid-length sequences is
# fastest with 64 owned rows on 4 warps (128 rows on 8 warps: doc-64k dK/dV 2.63 vs 2.22 ms).
# TMA (a fifth entry, True): the loop tiles come through tensor descriptors (`descriptors`), which
# the big global packs' passes run faster on (`benchmarks.attention_tma_probe`); a launch with
# descriptors goes through Triton's JIT (~20-40 us of host, nothing against a millisecond-long pass,
# but the eager short batches' loss: the smaller packs keep pointer loads). A layout descriptors
# cannot describe runs the same tile with pointer loads, bit for bit the same result.
TILE_WIDE = ((32, 32, 4, 1), (32, 32, 4, 1), (32, 32, 4, 1))  # head dim > 128: registers for M x 256
TILE_WINDOW = ((64, 32, 4, 2), (64, 32, 4, 2), (64, 32, 4, 2))  # local layers: every pass
TILE_SHORT = ((64, 32, 4, 2), (64, 32, 4, 2), (64, 32, 4, 2))  # global, max_seqlen <= 128 (query packs)
TILE_MID = ((64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2))  # global, T < 32k: more programs per wave
TILE_LONG = ((64, 64, 4, 3, True), (64, 64, 4, 3, True), (64, 32, 4, 2, True))  # global, T >= 32k: TMA loop tiles
SHORT_SEQLEN = 128
LONG_T = 32768


@functools.lru_cache(maxsize=64)  # host time: called on every launch
def _case(short: bool, long_t: bool, windowed: bool, head_dim: int):
    if head_dim > 128:
        return TILE_WIDE
    if windowed:
        return TILE_WINDOW
    if short:
        return TILE_SHORT
    if head_dim > 64:  # the long rows' 128-row accumulators spill at K = 128: the window rows' size
        return (TILE_LONG[0] if long_t else TILE_MID[0],) + TILE_WINDOW[1:]
    return TILE_LONG if long_t else TILE_MID


def _shape_class(T: int, max_seqlen: int, window: tuple[int, int], head_dim: int) -> tuple:
    """`_case`'s key: plain bools, so a trace with symbolic T or max_seqlen (torch.compile's dynamic
    shapes) guards on the two comparisons instead of hashing a SymInt; the head dim (symbolic under
    dynamic=True) is specialised, as it must be for the kernels' constexprs."""
    return bool(max_seqlen <= SHORT_SEQLEN), bool(T >= LONG_T), bool(window[0] >= 0 or window[1] >= 0), int(head_dim)


def tiles(T: int, max_seqlen: int, window: tuple[int, int], head_dim: int) -> tuple[int, int, int, int]:
    """The forward's (BLOCK_M, BLOCK_N, num_warps, num_stages) for one call."""
    return _case(*_shape_class(T, max_seqlen, window, head_dim))[0]


def bwd_tiles(T: int, max_seqlen: int, window: tuple[int, int], head_dim: int):
    """(dQ tile, dK/dV tile) for one call, each (owned rows, inner tile rows, num_warps, num_stages)."""
    return _case(*_shape_class(T, max_seqlen, window, head_dim))[1:]


# ---- launcher ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)  # host time: one dict per (head dim, window sides, dtype), not per launch
def _meta(Kd: int, window_l: bool, window_r: bool, fp32: bool) -> dict:
    return dict(HEAD_DIM=Kd, BLOCK_K=max(16, next_pow2(Kd)), WINDOW_L=window_l, WINDOW_R=window_r,
                PREC="ieee" if fp32 else "tf32")


def rope_table(inv_freq: Tensor, positions: int, scaling: float, dtype: torch.dtype) -> Tensor:
    """(positions, 2, BLOCK_K) fp32: cos and signed sin of split-half RoPE for positions
    0 .. positions - 1, `reference.rope_cos_sin`'s values; sin is negated on the first half (the
    rotation's sign), columns past K are 0. The fused forward's `_rope` reads it."""
    J = inv_freq.shape[0]
    cos, sin = reference.rope_cos_sin(torch.arange(positions, device=inv_freq.device), inv_freq, scaling, dtype)
    table = torch.zeros((positions, 2, max(16, next_pow2(2 * J))), device=inv_freq.device, dtype=torch.float32)
    table[:, 0, :2 * J] = cos
    table[:, 1, :2 * J] = torch.cat((-sin[:, :J], sin[:, J:]), 1)
    return table


def _rope_args(positions: Tensor, inv_freq: Tensor, table: Tensor, scaling: float) -> tuple:
    return positions, inv_freq, table, table.shape[0], scaling


def descriptors(block_rows: int, *xs: Tensor) -> tuple | None:
    """TMA descriptors of (T, H, K) views as (T, H * K) with (block_rows, K) blocks, or None when
    one cannot be described: heads not K apart, a base or a token stride off 16 bytes, a head dim
    that is not a power of two >= 16, or a traced (fake) tensor. The kernels' TMA tiles take whole
    blocks through them; the pointer loads do the same work for any layout."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    out = []
    for x in xs:
        T, H, Kd = x.shape
        st, sh, sk = x.stride()
        if (type(x) is not Tensor or sk != 1 or sh != Kd or Kd < 16 or Kd & (Kd - 1) or T == 0
                or (st * x.element_size()) % 16 or x.data_ptr() % 16):
            return None
        out.append(TensorDescriptor(x, [T, H * Kd], [st, 1], [block_rows, Kd]))
    return tuple(out)


def launch_args(q: Tensor, cu_seqlens: Tensor, window: tuple[int, int], scale: float):
    """(S, n_steps, left, right, qk_scale, constexprs) shared by the three kernels' launches.
    The constexpr dict is shared between calls: read it, never change it."""
    T, _, Kd = q.shape
    Kd = int(Kd)  # a constexpr: a symbolic head dim (dynamic=True) is specialised
    S = cu_seqlens.shape[0] - 1
    left, right = int(window[0]), int(window[1])
    meta = _meta(Kd, left >= 0, right >= 0, q.dtype == torch.float32)
    # n_steps: ceil(log2 S) binary-search steps; a symbolic S (a trace with dynamic shapes) takes
    # 31, enough for any int32 count, so the graph does not specialise on S (a few more L1 loads)
    n_steps = max(1, (S - 1).bit_length()) if type(S) is int else 31
    # windows are clamped to T: no int32 overflow in row +- window. float(): a symbolic scale
    # (dynamic=True derives it from a symbolic head dim) is specialised here, like the head dim,
    # rather than handed to the traced launch
    return S, n_steps, min(max(left, 0), T), min(max(right, 0), T), float(scale) * LOG2E, meta


def attention_fwd(
    q_THK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens: Tensor, max_seqlen: int,
    window: tuple[int, int], scale: float, *, lse: bool,
    tile: tuple[int, int, int, int] | None = None,
    rope: tuple[Tensor, Tensor, Tensor, float] | None = None,
    out: Tensor | None = None,
    head_major: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Launch the forward (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).

    Inputs are checked by the caller (`attention_op`): same (T, H, K) shape and float dtype, head
    dim contiguous and <= MAX_HEAD_DIM, cu_seqlens (S + 1,) int32 contiguous, scale > 0.
    Return: (out (T, H, K) in q's dtype, contiguous unless `out` says otherwise, LSE2 (H, T) fp32
    when `lse` else None).
    `tile` overrides `tiles(...)` (benchmarks, tests). `rope` = (positions (T,) int contiguous,
    inv_freq (K/2,) fp32, table (P, 2, BLOCK_K) fp32 from `rope_table`, scaling): q and k
    are rotated as they are read (even K; the key tiles are rotated once per query block that
    reads them, so this pays off on short sequences). `out`: a (T, H, K) tensor of q's dtype with
    a contiguous head dim to write into instead of a new one; q itself may be passed (a program
    reads its own query rows once, before it writes them, and no program reads another's).
    `head_major=False` runs the blocks fastest (`grid`; the order probe compares the two).
    """
    T, H, Kd = q_THK.shape
    o = torch.empty((T, H, Kd), dtype=q_THK.dtype, device=q_THK.device) if out is None else out
    lse2 = torch.empty((H, T), dtype=torch.float32, device=q_THK.device) if lse else None
    S, n_steps, left, right, qk_scale, meta = launch_args(q_THK, cu_seqlens, window, scale)
    if T == 0 or S <= 0:
        if lse2 is not None:
            lse2.zero_()
        return o.zero_(), lse2
    BM, BN, warps, stages, *tma = tile or tiles(T, max_seqlen, window, Kd)
    launch_grid, head_major = grid(cdiv(T, BM), H, head_major)
    desc = descriptors(BN, k_THK, v_THK) if tma and tma[0] else None
    args = (q_THK, k_THK, v_THK, *(desc or (k_THK, v_THK)), o, o if lse2 is None else lse2, cu_seqlens,
            T, S, n_steps, left, right, qk_scale,
            *q_THK.stride()[:2], *k_THK.stride()[:2], *v_THK.stride()[:2], *o.stride()[:2],
            *(_rope_args(*rope) if rope is not None else (cu_seqlens, o, o, 0, 1.0)))  # unused without RoPE
    opts = dict(BLOCK_M=BM, BLOCK_N=BN, STORE_LSE=lse, ROPE=rope is not None, HEAD_MAJOR=head_major,
                TMA=desc is not None, num_warps=warps, num_stages=stages, **meta)
    if desc is None:
        launch(_fwd_kernel, launch_grid, *args, **opts)
    else:  # descriptors are not `launch`'s cache keys: the JIT's launch (big packs only, `tiles`)
        _fwd_kernel[launch_grid](*args, **opts)
    return o, lse2
