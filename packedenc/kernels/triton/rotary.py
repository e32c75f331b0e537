"""Split-half (GPT-NeoX) RoPE on q and k, read straight from the fused Wqkv output.

Shapes: T packed tokens, H heads, K head dim, J = K/2 frequencies.

`_rotary_kernel`: a program takes BLOCK_T tokens x BLOCK_H heads. It computes each token's angles
pos * inv_freq in fp32 once, takes cos/sin in fp32 and rounds them to the activation dtype (as
transformers 5.x does before the rotation), rotates q and k in fp32 and rounds once. Positions
are per token, so packed sequences restart at 0 with no cu_seqlens lookup, and a token never
reads another token's data (isolation holds by construction).

inv_freq (J,) is computed on the host by `reference.rope_inv_freq` on the CPU, exactly as HF's
`__init__` does, and cached per (K, theta, device): pos * inv_freq then equals HF's fp32 angle
bit for bit, which matters at long positions (one ulp of inv_freq at position 8k is ~5e-4 rad).

The backward is the same kernel with -sin (the rotation's transpose), written into a (T, 3, H, K)
gradient whose v slot is zero.

`with_v=True` (training) also returns v as its own contiguous tensor, copied by the same kernel:
the attention then saves q, k, v (3 x T x D) and nothing keeps the whole Wqkv output alive as well
(5 x T x D before), and the backward takes dv too and writes all three slots of dqkv in one pass:
no zero-filled (T, 3, H, K) for v's select backward, no copy of dv into it and no add of that
buffer to the rotary gradient (three full (T, 3, D) passes per layer).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from packedenc.kernels import reference
from packedenc.kernels.reference import backward as reference_bwd
from packedenc.kernels.triton._common import (
    cdiv, check_float, direct_launch, eager_autograd, eager_cuda, launch, launch_or_op, next_pow2,
)

__all__ = ["rotary", "rotary_fwd", "rotary_bwd"]


@triton.jit
def _rotary_kernel(
    XQ, XK, XV,  # inputs: (T, H, K) views (q, k, v slots of qkv, or the incoming gradients)
    OQ, OK, OV,  # outputs: (T, H, K) tensors; with SLOTS, OQ is a (T, 3, H, K) buffer, OK / OV unused
    POS,  # (T,) int positions
    INV_FREQ,  # (J,) fp32
    T, H,
    s_xq_t, s_xq_h, s_xk_t, s_xk_h, s_xv_t, s_xv_h,  # input strides (elements); head dim contiguous
    s_oq_t, s_oq_h, s_ok_t, s_ok_h, s_ov_t, s_ov_h,  # output strides
    scaling,
    SIGN: tl.constexpr,  # +1 forward, -1 backward (transpose of the rotation)
    V_MODE: tl.constexpr,  # 0: v untouched, 1: copy XV to OV, 2: write zeros to OV
    J: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_J: tl.constexpr,
    SLOTS: tl.constexpr,  # write q, k, v into the slots of the one buffer OQ (slot stride s_oq_h * H)
):
    scaling = tl.cast(scaling, tl.float32)  # torch.compile passes Python floats as fp64
    if SLOTS:  # one output argument: torch.compile mis-handles several views of one buffer (rotary_bwd)
        OK = OQ + s_oq_h * H
        OV = OQ + 2 * s_oq_h * H
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_J)
    tmask, hmask, jmask = t < T, h < H, j < J
    pos = tl.load(POS + t, mask=tmask, other=0).to(tl.float32)
    inv = tl.load(INV_FREQ + j, mask=jmask, other=0.0)
    ang = pos[:, None] * inv[None, :]  # (BLOCK_T, BLOCK_J), the fp32 product HF forms
    dt = OQ.dtype.element_ty
    c = (tl.cos(ang) * scaling).to(dt).to(tl.float32)[:, None, :]
    s = (tl.sin(ang) * scaling).to(dt).to(tl.float32)[:, None, :] * SIGN
    mask = tmask[:, None, None] & hmask[None, :, None] & jmask[None, None, :]
    hj = h[None, :, None].to(tl.int64)

    xq = XQ + t[:, None, None] * s_xq_t + hj * s_xq_h + j[None, None, :]
    q1 = tl.load(xq, mask=mask, other=0.0).to(tl.float32)
    q2 = tl.load(xq + J, mask=mask, other=0.0).to(tl.float32)
    oq = OQ + t[:, None, None] * s_oq_t + hj * s_oq_h + j[None, None, :]
    tl.store(oq, (q1 * c - q2 * s).to(dt), mask=mask)
    tl.store(oq + J, (q2 * c + q1 * s).to(dt), mask=mask)

    xk = XK + t[:, None, None] * s_xk_t + hj * s_xk_h + j[None, None, :]
    k1 = tl.load(xk, mask=mask, other=0.0).to(tl.float32)
    k2 = tl.load(xk + J, mask=mask, other=0.0).to(tl.float32)
    ok = OK + t[:, None, None] * s_ok_t + hj * s_ok_h + j[None, None, :]
    tl.store(ok, (k1 * c - k2 * s).to(dt), mask=mask)
    tl.store(ok + J, (k2 * c + k1 * s).to(dt), mask=mask)

    if V_MODE != 0:  # v is not rotated: copied (or, for a gradient whose v part is absent, zeroed)
        ov = OV + t[:, None, None] * s_ov_t + hj * s_ov_h + j[None, None, :]
        if V_MODE == 1:
            xv = XV + t[:, None, None] * s_xv_t + hj * s_xv_h + j[None, None, :]
            v1 = tl.load(xv, mask=mask, other=0.0)
            v2 = tl.load(xv + J, mask=mask, other=0.0)
        else:
            v1 = tl.zeros([BLOCK_T, BLOCK_H, BLOCK_J], dtype=tl.float32)
            v2 = v1
        tl.store(ov, v1.to(dt), mask=mask)
        tl.store(ov + J, v2.to(dt), mask=mask)


TILE_ELEMS = 2048  # frequencies x heads x tokens per program (the sweep in benchmarks/results/history/NOTES-diary.md)
_INV_FREQ: dict[tuple[int, float, torch.device], Tensor] = {}


def _inv_freq(head_dim: int, theta: float, device: torch.device) -> Tensor:
    key = (head_dim, float(theta), device)
    inv = _INV_FREQ.get(key)
    if inv is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # A host->device copy cannot be captured; compute it on the device (may differ from
            # the CPU table by an ulp) and don't cache memory that belongs to the graph's pool.
            return reference.rope_inv_freq(head_dim, theta, device)
        inv = _INV_FREQ[key] = reference.rope_inv_freq(head_dim, theta, "cpu").to(device)
    return inv


def _launch(xq: Tensor, xk: Tensor, out: tuple[Tensor, ...] | Tensor, positions: Tensor, theta: float,
            scaling: float, sign: int, xv: Tensor | None = None) -> None:
    """Rotate xq, xk into the outputs; a third output gets a copy of xv (zeros when xv is None).

    `out`: (oq, ok) or (oq, ok, ov), separate (T, H, K) tensors, or one (T, 3, H, K) tensor whose
    three slots are written through the one argument (a triton_op's kernel must not be handed
    several views of one buffer to write: see `attention_bwd`)."""
    T, H, K = xq.shape
    if T == 0:
        return
    H, K = int(H), int(K)  # constexprs and a cache key: a symbolic width is specialised
    BLOCK_T, BLOCK_H, BLOCK_J, num_warps = _tile(H, K)
    grid = (cdiv(T, BLOCK_T), cdiv(H, BLOCK_H))
    slots = isinstance(out, Tensor)
    if slots:
        assert out.stride(1) == out.stride(2) * H, "rotary: the slots buffer must be a contiguous (T, 3, H, K)"
        oq = out.select(1, 0)
        ok = ov = oq  # strides only: the kernel derives the k and v slots from OQ
        ptrs = (out, xq, xq)  # unused OK / OV pointers: an input, never written
    else:
        oq, ok, *rest = out
        ov = rest[0] if rest else oq
        ptrs = (oq, ok, ov)
    v_mode = 0 if not slots and len(out) == 2 else 1 if xv is not None else 2
    xv_ = xq if xv is None else xv  # an unused pointer when mode 0
    launch(_rotary_kernel, grid,
        xq, xk, xv_, *ptrs, positions.contiguous(), _inv_freq(K, theta, xq.device),
        T, H,
        *xq.stride()[:2], *xk.stride()[:2], *xv_.stride()[:2], *oq.stride()[:2], *ok.stride()[:2], *ov.stride()[:2],
        scaling,
        SIGN=sign, V_MODE=v_mode, J=K // 2, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, BLOCK_J=BLOCK_J, SLOTS=slots,
        num_warps=num_warps,
    )


@functools.lru_cache(maxsize=64)  # host time: the tile depends on (H, K) only
def _tile(H: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_J, num_warps): about TILE_ELEMS frequencies x heads x tokens a program."""
    BLOCK_J = next_pow2(K // 2)
    BLOCK_H = min(next_pow2(H), max(1, 1024 // BLOCK_J))
    BLOCK_T = max(1, min(64, TILE_ELEMS // (BLOCK_H * BLOCK_J)))
    return BLOCK_T, BLOCK_H, BLOCK_J, 4 if BLOCK_T * BLOCK_H * BLOCK_J >= 2048 else 2


def _last_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rotary_fwd(qkv_T3HK: Tensor, positions_T: Tensor, theta: float, scaling: float = 1.0,
               with_v: bool = False) -> tuple[Tensor, ...]:
    """Launch the forward: contiguous (T, H, K) q and k (and a copy of v) from the (T, 3, H, K) Wqkv output."""
    check_float("rotary", qkv_T3HK)
    T, three, H, K = qkv_T3HK.shape
    assert three == 3 and K % 2 == 0, "rotary: qkv must be (T, 3, H, K) with an even head dim"
    qkv = _last_contiguous(qkv_T3HK)
    q = torch.empty((T, H, K), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty_like(q)
    if not with_v:
        _launch(qkv[:, 0], qkv[:, 1], (q, k), positions_T, theta, scaling, 1)
        return q, k
    v = torch.empty_like(q)
    _launch(qkv[:, 0], qkv[:, 1], (q, k, v), positions_T, theta, scaling, 1, xv=qkv[:, 2])
    return q, k, v


def rotary_bwd(dq_THK: Tensor, dk_THK: Tensor, positions_T: Tensor, theta: float, scaling: float = 1.0,
               dv_THK: Tensor | None = None) -> Tensor:
    """Launch the backward: (T, 3, H, K) gradient of qkv; its v slot is dv (zeros when None).

    Every slot is written by the kernel, so the buffer is allocated uninitialised."""
    dq, dk = _last_contiguous(dq_THK), _last_contiguous(dk_THK)
    dv = None if dv_THK is None else _last_contiguous(dv_THK)
    T, H, K = dq.shape
    dqkv = torch.empty((T, 3, H, K), dtype=dq.dtype, device=dq.device)
    _launch(dq, dk, dqkv, positions_T, theta, scaling, -1, xv=dv)
    return dqkv


# ---- registered ops: (q, k) for inference, (q, k, v) for training ------------------------------


def _rotary_cuda(qkv, positions, theta, scaling=1.0):
    return rotary_fwd(qkv, positions, theta, scaling)


@triton_op("packedenc::rotary", mutates_args=())
def _rotary(qkv: Tensor, positions: Tensor, theta: float, scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    if qkv.is_cuda:
        return _rotary_cuda(qkv, positions, theta, scaling)
    q, k = reference.rotary(qkv, positions, theta, scaling)
    return q.contiguous(), k.contiguous()


def _rotary_bwd_cuda(dq, dk, positions, theta, scaling):
    return rotary_bwd(dq, dk, positions, theta, scaling)


@triton_op("packedenc::rotary_bwd", mutates_args=())
def _rotary_bwd(dq: Tensor, dk: Tensor, positions: Tensor, theta: float, scaling: float) -> Tensor:
    if dq.is_cuda:
        return _rotary_bwd_cuda(dq, dk, positions, theta, scaling)
    return reference_bwd.rotary_bwd(dq, dk, positions, theta, scaling)


def _setup(ctx, inputs, output):
    qkv, positions, theta, scaling = inputs
    ctx.save_for_backward(positions)
    ctx.theta, ctx.scaling = theta, scaling


def _backward(ctx, dq, dk):
    (positions,) = ctx.saved_tensors
    dqkv = launch_or_op(_rotary_bwd_cuda, torch.ops.packedenc.rotary_bwd, dq, dk, positions, ctx.theta, ctx.scaling)
    return dqkv, None, None, None


_rotary.register_autograd(_backward, setup_context=_setup)
_rotary_eager = eager_autograd(_rotary_cuda, _setup, _backward)


def _rotary_qkv_cuda(qkv, positions, theta, scaling=1.0):
    return rotary_fwd(qkv, positions, theta, scaling, with_v=True)


@triton_op("packedenc::rotary_qkv", mutates_args=())
def _rotary_qkv(qkv: Tensor, positions: Tensor, theta: float, scaling: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    if qkv.is_cuda:
        return _rotary_qkv_cuda(qkv, positions, theta, scaling)
    q, k, v = reference.rotary(qkv, positions, theta, scaling, with_v=True)
    return q.contiguous(), k.contiguous(), v.contiguous()


def _rotary_qkv_bwd_cuda(dq, dk, dv, positions, theta, scaling):
    return rotary_bwd(dq, dk, positions, theta, scaling, dv)


@triton_op("packedenc::rotary_qkv_bwd", mutates_args=())
def _rotary_qkv_bwd(dq: Tensor, dk: Tensor, dv: Tensor, positions: Tensor, theta: float, scaling: float) -> Tensor:
    if dq.is_cuda:
        return _rotary_qkv_bwd_cuda(dq, dk, dv, positions, theta, scaling)
    return reference_bwd.rotary_bwd(dq, dk, positions, theta, scaling, dv)


def _qkv_backward(ctx, dq, dk, dv):
    (positions,) = ctx.saved_tensors
    dqkv = launch_or_op(_rotary_qkv_bwd_cuda, torch.ops.packedenc.rotary_qkv_bwd, dq, dk, dv, positions, ctx.theta,
                        ctx.scaling)
    return dqkv, None, None, None


_rotary_qkv.register_autograd(_qkv_backward, setup_context=_setup)
_rotary_qkv_eager = eager_autograd(_rotary_qkv_cuda, _setup, _qkv_backward)


def rotary(qkv_T3HK: Tensor, positions_T: Tensor, theta: float, scaling: float = 1.0,
           with_v: bool = False, overwrite_input: bool = False) -> tuple[Tensor, ...]:
    """RoPE on q and k of the fused (T, 3, H, K) Wqkv output; see `reference.rotary`.

    Return: q_THK, k_THK contiguous in qkv's dtype; with `with_v`, also v_THK: its own contiguous
    copy when a gradient is needed (see the module docstring), else the view qkv[:, 2].
    With `overwrite_input` in eager inference, q and k are rotated in place inside qkv and all
    three come back as (T, H, K) views of it (head dim contiguous): two (T, H, K) buffers fewer.
    Each program loads its elements before it stores them, so the in-place rotation is exact.
    """
    if not with_v or not (torch.is_grad_enabled() and qkv_T3HK.requires_grad):
        if overwrite_input and direct_launch(qkv_T3HK) and qkv_T3HK.stride(-1) == 1:
            check_float("rotary", qkv_T3HK)
            q, k = qkv_T3HK[:, 0], qkv_T3HK[:, 1]
            _launch(q, k, (q, k), positions_T, theta, scaling, 1)  # direct launches only: never traced
            return (q, k, qkv_T3HK[:, 2]) if with_v else (q, k)
        if direct_launch(qkv_T3HK):
            q, k = rotary_fwd(qkv_T3HK, positions_T, theta, scaling)
        elif eager_cuda(qkv_T3HK):
            q, k = _rotary_eager(qkv_T3HK, positions_T, float(theta), float(scaling))
        else:
            q, k = torch.ops.packedenc.rotary(qkv_T3HK, positions_T, theta, scaling)
        return (q, k, qkv_T3HK[:, 2]) if with_v else (q, k)
    if eager_cuda(qkv_T3HK):
        return _rotary_qkv_eager(qkv_T3HK, positions_T, float(theta), float(scaling))
    return torch.ops.packedenc.rotary_qkv(qkv_T3HK, positions_T, theta, scaling)
