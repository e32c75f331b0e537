"""Packed varlen attention (forward, inference): token-block tiles that short sequences share.

Shapes: T packed tokens, S sequences, H heads, K head dim, M = BLOCK_M query rows and
N = BLOCK_N key rows of a tile.

Why not FA2's layout: torch's FA2 varlen tiles each sequence on its own in 128-row blocks, so a
24-token query sequence pays for a 128 x 128 tile (80% wasted), and a (64, 64) window over
~350-token documents touches up to 3 x 128 = 384 keys per row: local layers cost as much as
global ones. Here the grid runs over blocks of M *consecutive packed rows*, whatever sequence
they belong to:

`_fwd_kernel`, one program per (row block, head):
  - each row finds its sequence [start, end) by a binary search of cu_seqlens (S + 1 int32,
    L1/L2 resident; ceil(log2 S) steps), so nothing per token is precomputed, cached or synced;
  - row i may see keys [lo_i, hi_i) = [max(start, i - left), min(end, i + right + 1)) (FA's
    inclusive window, -1 unbounded). lo_i and hi_i never decrease with i, so the block's keys
    are the one contiguous range [lo of its first row, hi of its last row), looped over in N-row
    tiles from exactly that start (no alignment: a 64-row block under a (64, 64) window reads
    M + 128 = 192 keys, every tile of a global block of a 24-token query pack ~2-4 sequences);
  - tiles that cross some row's bound are masked per row by [lo_i, hi_i), which also keeps
    sequences apart: a row never mixes in a key of another sequence (isolation holds for any
    tiling); tiles inside every row's range (the interior of a long sequence, the middle tile
    of a window) skip the compares;
  - scores q k^T by tl.dot (bf16/fp16 inputs, fp32 accumulate; exact fp32 for fp32 inputs),
    online softmax in fp32 with exp2 and scale * log2(e) folded into one multiply, P rounded to
    v's dtype for P V (as FA2), one rounding of the output.
Rows whose running max is still -inf (their keys start in a later tile) use 0 as the shift, so
exp2 gives exact zeros rather than NaN.

`varlen_attention` (the "triton" entry of the Ops table, first for backend="auto") is forward
only: when autograd needs gradients it calls the flash backend (FA2, which has a backward). Its
rule (`prefer_triton`, host values only) also leaves to FA2 what was not measured faster here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from packedenc.kernels import reference
from packedenc.kernels.triton._common import cdiv, check_float, direct_launch, next_pow2

__all__ = ["varlen_attention", "triton_varlen_attention", "varlen_attention_fwd", "prefer_triton", "tiles"]

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


@triton.jit
def _attend(acc, l_i, m_i, q, K, V, h, s_k_t, s_k_h, s_v_t, s_v_h, j_lo, j_hi, blk_hi, kl, kh, qk_scale,
            offs_n, offs_k, kmask, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_K: tl.constexpr,
            PREC: tl.constexpr):
    """Online softmax over key tiles j_lo, j_lo + N, ... < j_hi. MASKED: per-row ranges [kl, kh)
    and loads guarded at blk_hi; unmasked tiles lie inside every row's range (no compares)."""
    for j0 in range(j_lo, j_hi, BLOCK_N):
        cols = j0 + offs_n
        c64 = cols.to(tl.int64)[:, None]
        kp = K + c64 * s_k_t + h * s_k_h + offs_k[None, :]
        vp = V + c64 * s_v_t + h * s_v_h + offs_k[None, :]
        if MASKED:
            cmask = (cols < blk_hi)[:, None] & kmask[None, :]
            k = tl.load(kp, mask=cmask, other=0.0)
            v = tl.load(vp, mask=cmask, other=0.0)
        elif EVEN_K:  # a full tile: no mask at all
            k = tl.load(kp)
            v = tl.load(vp)
        else:
            k = tl.load(kp, mask=kmask[None, :], other=0.0)
            v = tl.load(vp, mask=kmask[None, :], other=0.0)
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


@triton.jit(do_not_specialize=["T", "S", "n_steps", "left", "right"])
def _fwd_kernel(
    Q, K, V,  # (T, H, K) views, head dim contiguous (v may be a slice of the fused qkv)
    O,  # (T, H, K) out
    CU,  # (S + 1,) int32 cu_seqlens
    T, S, n_steps,  # tokens, sequences, binary-search steps (>= ceil(log2 S))
    left, right,  # window; read only when WINDOW_L / WINDOW_R
    qk_scale,  # scale * log2(e), > 0
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_o_t, s_o_h,  # strides in elements
    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr,
    PREC: tl.constexpr,  # tl.dot input_precision ("ieee" for fp32 inputs)
):
    h = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # int32 packed row ids
    mmask = rows < T
    r = tl.minimum(rows, T - 1)

    # Sequence of each row: the largest s with cu[s] <= r (invariant cu[lo] <= r < cu[hi]).
    lo = tl.zeros([BLOCK_M], tl.int32)
    hi = tl.zeros([BLOCK_M], tl.int32) + S
    for _ in range(n_steps):
        mid = (lo + hi) >> 1
        go = tl.load(CU + mid) <= r
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    kl = tl.load(CU + lo)  # row i sees keys [kl_i, kh_i)
    end = tl.load(CU + hi)
    kh = end
    if WINDOW_L:
        kl = tl.maximum(kl, rows - left)
    if WINDOW_R:
        kh = tl.minimum(kh, rows + right + 1)
    valid = mmask & (rows < end)  # rows past cu[S] (if any) see no key and get 0
    kh = tl.where(valid, kh, kl)
    # The block's key range, and the part of it every row sees: tiles from blk_lo; those inside
    # [full_lo, full_hi) skip the per-element mask.
    blk_lo = tl.min(tl.where(valid, kl, T), 0)
    blk_hi = tl.max(tl.where(valid, kh, 0), 0)
    full_lo = tl.max(tl.where(valid, kl, 0), 0)
    full_hi = tl.min(tl.where(valid, kh, T), 0)
    mid_lo = blk_lo + tl.cdiv(tl.maximum(full_lo - blk_lo, 0), BLOCK_N) * BLOCK_N
    mid_hi = mid_lo + tl.maximum(full_hi - mid_lo, 0) // BLOCK_N * BLOCK_N

    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < HEAD_DIM
    q = tl.load(Q + rows.to(tl.int64)[:, None] * s_q_t + h * s_q_h + offs_k[None, :],
                mask=mmask[:, None] & kmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K, V, h, s_k_t, s_k_h, s_v_t, s_v_h,
                            blk_lo, mid_lo, blk_hi, kl, kh, qk_scale,
                            offs_n, offs_k, kmask, BLOCK_N, True, HEAD_DIM == BLOCK_K, PREC)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K, V, h, s_k_t, s_k_h, s_v_t, s_v_h,
                            mid_lo, mid_hi, blk_hi, kl, kh, qk_scale,
                            offs_n, offs_k, kmask, BLOCK_N, False, HEAD_DIM == BLOCK_K, PREC)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, K, V, h, s_k_t, s_k_h, s_v_t, s_v_h,
                            mid_hi, blk_hi, blk_hi, kl, kh, qk_scale,
                            offs_n, offs_k, kmask, BLOCK_N, True, HEAD_DIM == BLOCK_K, PREC)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out = tl.where(valid[:, None], out, 0.0)
    tl.store(O + rows.to(tl.int64)[:, None] * s_o_t + h * s_o_h + offs_k[None, :],
             out.to(O.dtype.element_ty), mask=mmask[:, None] & kmask[None, :])


# ---- tiles and launcher ------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages) for head dims <= 128, from the H200 sweep at H=12,
# K=64 (benchmarks/bench_attention.py --sweep, NOTES.md). Module-level so the sweep can override.
TILE_WINDOW = (64, 32, 4, 2)  # local layers: 0.90-0.95x the time of 64 x 64 on every pack
TILE_SHORT = (64, 32, 4, 2)  # global, max_seqlen <= SHORT_SEQLEN (query packs: 14.0 vs 15.4 us)
TILE_MID = (64, 64, 4, 3)  # global, T < LONG_T: more programs per wave (doc 32 x ~350: 133 vs 146 us)
TILE_LONG = (128, 64, 8, 3)  # global, T >= LONG_T: best from 34k to 81k tokens, lengths 256..8k
SHORT_SEQLEN = 128
LONG_T = 32768


def tiles(T: int, max_seqlen: int, window: tuple[int, int], head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for one call, from host values only."""
    if head_dim > 128:  # fp32 accumulator of M x 256: keep register pressure down
        return 32, 32, 4, 1
    if window[0] >= 0 or window[1] >= 0:
        return TILE_WINDOW
    if max_seqlen <= SHORT_SEQLEN:
        return TILE_SHORT
    return TILE_MID if T < LONG_T else TILE_LONG


def _check(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> None:
    check_float("varlen_attention", q, k, v)
    assert q.dim() == 3 and q.shape == k.shape == v.shape, (q.shape, k.shape, v.shape)
    assert q.dtype == k.dtype == v.dtype, "varlen_attention: q, k, v must share a dtype"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "varlen_attention: head dim must be contiguous"
    assert q.shape[-1] <= MAX_HEAD_DIM, f"varlen_attention: head dim {q.shape[-1]} > {MAX_HEAD_DIM}"
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1, "cu_seqlens must be (S+1,) int32"


def varlen_attention_fwd(
    q_THK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens: Tensor, max_seqlen: int,
    window: tuple[int, int] = (-1, -1), scale: float | None = None,
    tile: tuple[int, int, int, int] | None = None,
) -> Tensor:
    """Launch the kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).

    Return: (T, H, K) contiguous in q's dtype. `tile` overrides `tiles(...)` (benchmarks, tests).
    """
    _check(q_THK, k_THK, v_THK, cu_seqlens)
    T, H, Kd = q_THK.shape
    S = cu_seqlens.numel() - 1
    o = torch.empty((T, H, Kd), dtype=q_THK.dtype, device=q_THK.device)
    if T == 0 or S <= 0:
        return o.zero_()
    left, right = int(window[0]), int(window[1])
    scale = Kd**-0.5 if scale is None else float(scale)
    assert scale > 0, f"varlen_attention: the Triton kernel needs scale > 0, got {scale}"
    BM, BN, warps, stages = tile or tiles(T, max_seqlen, (left, right), Kd)
    cu = cu_seqlens if cu_seqlens.is_contiguous() else cu_seqlens.contiguous()
    _fwd_kernel[(cdiv(T, BM), H)](
        q_THK, k_THK, v_THK, o, cu,
        T, S, max(1, (S - 1).bit_length()),
        min(max(left, 0), T), min(max(right, 0), T), scale * LOG2E,  # clamped: no int32 overflow
        q_THK.stride(0), q_THK.stride(1), k_THK.stride(0), k_THK.stride(1),
        v_THK.stride(0), v_THK.stride(1), o.stride(0), o.stride(1),
        HEAD_DIM=Kd, BLOCK_K=max(16, next_pow2(Kd)), BLOCK_M=BM, BLOCK_N=BN,
        WINDOW_L=left >= 0, WINDOW_R=right >= 0,
        PREC="ieee" if q_THK.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages,
    )
    return o


# ---- registered op (CPU: the reference; CUDA: the kernel). Forward only, no autograd. -----------


@torch.library.custom_op("packedenc::triton_varlen_attention", mutates_args=(), device_types="cpu")
def _op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, left: int, right: int,
        scale: float | None) -> Tensor:
    return reference.varlen_attention(q, k, v, cu_seqlens, max_seqlen, (left, right), scale).contiguous()


@_op.register_kernel("cuda")
def _(q, k, v, cu_seqlens, max_seqlen, left, right, scale):
    return varlen_attention_fwd(q, k, v, cu_seqlens, max_seqlen, (left, right), scale)


@_op.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, left, right, scale):
    return q.new_empty(q.shape)


# ---- the Ops-table entries ---------------------------------------------------------------------

# The auto rule (host values only, no sync), from the H200 measurements in benchmarks/NOTES.md
# (bf16, H=12, K=64): with a window the kernel took 0.30-0.40x FA2's time on every pack (query,
# doc, 64k doc budget, 8 x ~4k); global, 0.37x on the query pack, 0.81-0.89x on doc / 64k doc /
# long, 0.76-1.01x over packs of equal lengths 256..4096 (256: a tie). So there is no length
# crossover to encode; global layers with head dims above 64 (not measured) stay on FA2.
GLOBAL_MAX_HEAD_DIM = 64


def prefer_triton(window: tuple[int, int], head_dim: int) -> bool:
    """True where the Triton kernel measured faster than torch's FA2 varlen on an H200."""
    if window[0] >= 0 or window[1] >= 0:
        return True
    return head_dim <= GLOBAL_MAX_HEAD_DIM


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _kernel_ok(q: Tensor) -> bool:
    return q.is_cuda and q.shape[-1] <= MAX_HEAD_DIM


def _flash_ok(q: Tensor) -> bool:  # what flash.varlen_attention runs as FA2 (else it uses the reference)
    K = q.shape[-1]
    return q.dtype in (torch.float16, torch.bfloat16) and K % 8 == 0 and K <= 256


def _flash(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window, scale):
    """The flash backend (FA2, with a backward); the reference on CPU or without flash."""
    if q_THK.is_cuda:
        try:
            from packedenc.kernels import flash  # imported on first use: training / long global layers
        except ImportError:  # no varlen flash kernel in this torch
            flash = None
        if flash is not None:
            return flash.varlen_attention(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window, scale)
    return reference.varlen_attention(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window, scale)


def triton_varlen_attention(
    q_THK: Tensor,
    k_THK: Tensor,
    v_THK: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
) -> Tensor:
    """The Triton kernel for every inference call (no auto rule); see `varlen_attention`.

    When a gradient is needed (grad mode on and an input requires grad) it calls the flash
    backend, which has a backward; the kernel itself is forward only.
    """
    if _needs_grad(q_THK, k_THK, v_THK) or not _kernel_ok(q_THK):
        return _flash(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window, scale)
    left, right = int(window[0]), int(window[1])
    if direct_launch(q_THK, k_THK, v_THK):
        return varlen_attention_fwd(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, (left, right), scale)
    return torch.ops.packedenc.triton_varlen_attention(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, left, right, scale)


def varlen_attention(
    q_THK: Tensor,
    k_THK: Tensor,
    v_THK: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
) -> Tensor:
    """Non-causal varlen attention with an FA window: the Triton kernel where it wins, else FA2.

    Same signature and semantics as `reference.varlen_attention` / `flash.varlen_attention`.
    Per call, from host values only (no device sync):
      - a gradient is needed (grad mode on, an input requires grad): flash (FA2 forward and
        backward; this kernel has no backward);
      - `prefer_triton(window, head_dim)`: the Triton kernel (windowed layers; global layers with
        head dims <= 64), else flash (global layers with larger head dims, not measured);
      - fp32 or head dims FA2 does not take: the kernel (flash would use the dense reference).
    To run the kernel on every inference call, use `triton_varlen_attention`.

    Arguments:
        q_THK, k_THK, v_THK: (T, H, K) packed, head dim contiguous (v may be a view of fused qkv).
        cu_seqlens: (S+1,) int32 on q's device. max_seqlen: host int >= the longest sequence.
        window: (left, right), query i sees keys i - left .. i + right, -1 unbounded.
        scale: softmax scale, default K ** -0.5.
    Return:
        (T, H, K) in q's dtype; fp32 softmax; a token never sees another sequence.
    """
    fa2 = _flash_ok(q_THK)  # fp32 / odd head dims: FA2 would fall back to the dense reference
    if (_needs_grad(q_THK, k_THK, v_THK) or (fa2 and not prefer_triton(window, q_THK.shape[-1]))
            or (scale is not None and scale <= 0)):  # the kernel folds a positive scale into its max
        return _flash(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window, scale)
    return triton_varlen_attention(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window, scale)
