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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from packedenc.kernels import reference
from packedenc.kernels import reference_bwd
from packedenc.kernels.triton._common import check_float, direct_launch

__all__ = ["rotary", "rotary_fwd", "rotary_bwd"]


@triton.jit
def _rotary_kernel(
    XQ, XK,  # inputs: (T, H, K) views (q and k slots of qkv, or the incoming gradients)
    OQ, OK,  # outputs: (T, H, K) views
    POS,  # (T,) int positions
    INV_FREQ,  # (J,) fp32
    T, H,
    s_xq_t, s_xq_h, s_xk_t, s_xk_h,  # input strides (elements); head dim contiguous
    s_oq_t, s_oq_h, s_ok_t, s_ok_h,  # output strides
    scaling,
    SIGN: tl.constexpr,  # +1 forward, -1 backward (transpose of the rotation)
    J: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
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


TILE_ELEMS = 2048  # frequencies x heads x tokens per program (benchmarks/bench_ops.py --sweep)
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


def _launch(xq: Tensor, xk: Tensor, oq: Tensor, ok: Tensor, positions: Tensor, theta: float,
            scaling: float, sign: int) -> None:
    T, H, K = xq.shape
    if T == 0:
        return
    J = K // 2
    BLOCK_J = triton.next_power_of_2(J)
    BLOCK_H = min(triton.next_power_of_2(H), max(1, 1024 // BLOCK_J))
    BLOCK_T = max(1, min(64, TILE_ELEMS // (BLOCK_H * BLOCK_J)))
    num_warps = 4 if BLOCK_T * BLOCK_H * BLOCK_J >= 2048 else 2
    grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(H, BLOCK_H))
    _rotary_kernel[grid](
        xq, xk, oq, ok, positions.contiguous(), _inv_freq(K, theta, xq.device),
        T, H,
        xq.stride(0), xq.stride(1), xk.stride(0), xk.stride(1),
        oq.stride(0), oq.stride(1), ok.stride(0), ok.stride(1),
        scaling,
        SIGN=sign, J=J, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, BLOCK_J=BLOCK_J, num_warps=num_warps,
    )


def _last_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rotary_fwd(qkv_T3HK: Tensor, positions_T: Tensor, theta: float, scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """Launch the forward: contiguous (T, H, K) q and k from the (T, 3, H, K) Wqkv output."""
    check_float("rotary", qkv_T3HK)
    T, three, H, K = qkv_T3HK.shape
    assert three == 3 and K % 2 == 0, "rotary: qkv must be (T, 3, H, K) with an even head dim"
    qkv = _last_contiguous(qkv_T3HK)
    q = torch.empty((T, H, K), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty_like(q)
    _launch(qkv[:, 0], qkv[:, 1], q, k, positions_T, theta, scaling, 1)
    return q, k


def rotary_bwd(dq_THK: Tensor, dk_THK: Tensor, positions_T: Tensor, theta: float, scaling: float = 1.0) -> Tensor:
    """Launch the backward: (T, 3, H, K) gradient of qkv, zero in the v slot."""
    dq, dk = _last_contiguous(dq_THK), _last_contiguous(dk_THK)
    T, H, K = dq.shape
    dqkv = torch.empty((T, 3, H, K), dtype=dq.dtype, device=dq.device)
    dqkv[:, 2].zero_()
    _launch(dq, dk, dqkv[:, 0], dqkv[:, 1], positions_T, theta, scaling, -1)
    return dqkv


@torch.library.custom_op("packedenc::rotary", mutates_args=(), device_types="cpu")
def _rotary(qkv: Tensor, positions: Tensor, theta: float, scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    q, k = reference.rotary(qkv, positions, theta, scaling)
    return q.contiguous(), k.contiguous()


@_rotary.register_kernel("cuda")
def _(qkv, positions, theta, scaling=1.0):
    return rotary_fwd(qkv, positions, theta, scaling)


@_rotary.register_fake
def _(qkv, positions, theta, scaling=1.0):
    T, _, H, K = qkv.shape
    return qkv.new_empty((T, H, K)), qkv.new_empty((T, H, K))


@torch.library.custom_op("packedenc::rotary_bwd", mutates_args=(), device_types="cpu")
def _rotary_bwd(dq: Tensor, dk: Tensor, positions: Tensor, theta: float, scaling: float) -> Tensor:
    return reference_bwd.rotary_bwd(dq, dk, positions, theta, scaling)


@_rotary_bwd.register_kernel("cuda")
def _(dq, dk, positions, theta, scaling):
    return rotary_bwd(dq, dk, positions, theta, scaling)


@_rotary_bwd.register_fake
def _(dq, dk, positions, theta, scaling):
    T, H, K = dq.shape
    return dq.new_empty((T, 3, H, K))


def _setup(ctx, inputs, output):
    qkv, positions, theta, scaling = inputs
    ctx.save_for_backward(positions)
    ctx.theta, ctx.scaling = theta, scaling


def _backward(ctx, dq, dk):
    (positions,) = ctx.saved_tensors
    return torch.ops.packedenc.rotary_bwd(dq, dk, positions, ctx.theta, ctx.scaling), None, None, None


_rotary.register_autograd(_backward, setup_context=_setup)


def rotary(qkv_T3HK: Tensor, positions_T: Tensor, theta: float, scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """RoPE on q and k of the fused (T, 3, H, K) Wqkv output; see `reference.rotary`.

    Return: q_THK, k_THK contiguous in qkv's dtype (v is left to the caller: qkv[:, 2]).
    """
    if direct_launch(qkv_T3HK):
        return rotary_fwd(qkv_T3HK, positions_T, theta, scaling)
    return torch.ops.packedenc.rotary(qkv_T3HK, positions_T, theta, scaling)
