"""GEMMs for host-bound eager inference: `linear`, `linear_add`, `linear_glu` as one Triton kernel.

Shapes: T packed tokens (M), D input width (K), N output width, F mlp width.

Why: an eager batch of a few thousand tokens is host-bound (issue 19): each cuBLAS call through
`F.linear` / `addmm` costs tens of microseconds of host time (aten's linear -> matmul -> mm and
cuBLASLt's setup), four per layer, while `_common.launch` starts a cached Triton kernel in a few.
The GPU does the same work a little slower, which a host-bound batch never waits for. Which calls
come here is the op table's choice (`kernels/auto.py`); `covers` says which ones it can take:
eager inference (nothing needs a gradient), fp16 / bf16, row-major operands.

`_gemm_kernel` computes a (BLOCK_M, BLOCK_N) tile of x @ W^T with fp32 accumulation and one of
three epilogues, each rounding as the ops it replaces do (`reference.linear`, `linear_add`,
`linear_glu`):
- LINEAR: acc + bias, one rounding (cuBLAS adds the bias in its epilogue);
- ADD: acc + residual, one rounding; with a bias the residual is first rounded with it
  (`reference.linear_add` adds the bias into the residual, then the GEMM);
- GLU: two accumulators, W's row n and row n + F; each rounded (with its bias) to the dtype, as
  the GEMM output u would be, then act(u_in) * u_gate in fp32, one rounding (`reference.glu`).
Rows past M and columns past N read row M - 1 / column N - 1 (in bounds, never stored), so the
loads need no mask; only a K that is not a multiple of BLOCK_K masks its last step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from packedenc.errors import InputError
from packedenc.kernels.triton._common import cdiv, direct_launch, launch
from packedenc.kernels.triton.glu import _act, _code

__all__ = ["linear", "linear_add", "linear_glu", "covers_linear", "covers_linear_add", "covers_linear_glu",
           "gemm", "tile"]

LINEAR, ADD, GLU = 0, 1, 2
_LOW = (torch.float16, torch.bfloat16)


@triton.jit
def _gemm_kernel(
    X,  # (M, K), row stride stride_x
    W,  # (N, K) or, for GLU, (2N, K): input rows, then gate rows
    BIAS,  # (N,) / (2N,) (unread without HAS_BIAS)
    RES,  # (M, N) residual (unread unless EPILOGUE == ADD)
    OUT,  # (M, N)
    M, N, K,
    stride_x, stride_w, stride_r, stride_o,
    EPILOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 operands (full-precision dots: the CPU tests), else "tf32"
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # grouped order: GROUP_M row tiles share each column tile of W while it is in L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    xm = tl.minimum(rm, M - 1).to(tl.int64)
    wn = tl.minimum(rn, N - 1).to(tl.int64)
    x_ptr = X + xm[:, None] * stride_x + rk[None, :]
    w_ptr = W + wn[:, None] * stride_w + rk[None, :]
    g_ptr = w_ptr + N * stride_w  # GLU: the gate rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptr)
            b = tl.load(w_ptr)
        else:
            kk = (rk < K - k * BLOCK_K)[None, :]
            a = tl.load(x_ptr, mask=kk, other=0.0)
            b = tl.load(w_ptr, mask=kk, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        if EPILOGUE == 2:
            if EVEN_K:
                bg = tl.load(g_ptr)
            else:
                bg = tl.load(g_ptr, mask=kk, other=0.0)
            acc_g = tl.dot(a, tl.trans(bg), acc_g, input_precision=PRECISION)
            g_ptr += BLOCK_K
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K

    dt = OUT.dtype.element_ty
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    om = rm.to(tl.int64)
    if EPILOGUE == 0:
        if HAS_BIAS:
            acc += tl.load(BIAS + wn).to(tl.float32)[None, :]
        y = acc
    elif EPILOGUE == 1:
        r = tl.load(RES + om[:, None] * stride_r + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            r = (r + tl.load(BIAS + wn).to(tl.float32)[None, :]).to(dt).to(tl.float32)
        y = acc + r
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + wn).to(tl.float32)[None, :]
            acc_g += tl.load(BIAS + N + wn).to(tl.float32)[None, :]
        u, _ = _act(acc.to(dt).to(tl.float32), ACT)
        y = u * acc_g.to(dt).to(tl.float32)
    tl.store(OUT + om[:, None] * stride_o + rn[None, :], y.to(dt), mask=mask)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): a GLU tile's BLOCK_N is per half (two accumulators)
_TILE_WIDE = (128, 128, 64, 8, 3)
_TILE_NARROW = (64, 128, 64, 4, 4)
_TILE_GLU = (128, 64, 64, 8, 3)


def tile(M: int, N: int, K: int, epilogue: int) -> tuple[int, int, int, int, int]:
    """The tile of a (M, N, K) GEMM: fixed by shape (no autotune; see `_common`'s docstring)."""
    if epilogue == GLU:
        return _TILE_GLU
    # fewer than two waves of 128 x 128 tiles on an H100 / H200 (132 SMs): halve the row tile
    return _TILE_NARROW if cdiv(M, 128) * cdiv(N, 128) < 264 else _TILE_WIDE


def gemm(x_TK: Tensor, weight: Tensor, bias: Tensor | None, epilogue: int, residual: Tensor | None = None,
         act: int = 0, out: Tensor | None = None, tile_: tuple[int, int, int, int, int] | None = None) -> Tensor:
    """Launch `_gemm_kernel`: (T, N) (GLU: N = weight rows / 2) into `out` or a new tensor.
    The caller checked the layouts (`_check`); `tile_` overrides `tile` (the probe)."""
    T, K = x_TK.shape
    N = weight.shape[0] // 2 if epilogue == GLU else weight.shape[0]
    if out is None:
        out = torch.empty((T, N), dtype=x_TK.dtype, device=x_TK.device)
    if T == 0:
        return out
    BM, BN, BK, warps, stages = tile_ or tile(T, N, K, epilogue)
    res = residual if residual is not None else out
    launch(_gemm_kernel, (cdiv(T, BM) * cdiv(N, BN),), x_TK, weight, weight if bias is None else bias, res, out,
           T, N, K, x_TK.stride(0), weight.stride(0), res.stride(0), out.stride(0),
           EPILOGUE=epilogue, HAS_BIAS=bias is not None, ACT=act, PRECISION="ieee" if x_TK.dtype == torch.float32 else "tf32",
           EVEN_K=K % BK == 0, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def _layout(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None = None) -> str | None:
    """Why the kernel cannot take these operands (None: it can). Host values only."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return f"x {tuple(x.shape)} @ weight.T {tuple(weight.shape[::-1])}: expected (T, K) @ (K, N)"
    if not x.dtype == weight.dtype or (bias is not None and bias.dtype != x.dtype) or (
            residual is not None and residual.dtype != x.dtype):
        return "x, weight, bias and residual must share a dtype"
    if x.stride(1) != 1 or weight.stride(1) != 1 or (bias is not None and bias.stride(0) != 1) or (
            residual is not None and residual.stride(1) != 1):
        return "the operands' last dims must be contiguous"
    return None


def _check(what: str, x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None = None) -> None:
    why = _layout(x, weight, bias, residual)
    if why is None and x.dtype not in (*_LOW, torch.float32):
        why = f"expected float16, bfloat16 or float32, got {x.dtype}"
    if why is not None:
        raise InputError(f"triton {what}: {why}")


def _covers(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None = None) -> bool:
    """Eager CUDA inference on fp16 / bf16 row-major operands: what the op table may send here."""
    return (x.dtype in _LOW and direct_launch(x, weight, bias, residual)
            and _layout(x, weight, bias, residual) is None)


def covers_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    return _covers(x, weight, bias)


def covers_linear_add(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor,
                      overwrite_input: bool = False) -> bool:
    return residual.shape == (x.shape[0], weight.shape[0]) and _covers(x, weight, bias, residual)


def covers_linear_glu(x: Tensor, weight: Tensor, bias: Tensor | None = None, act: str = "gelu") -> bool:
    return weight.shape[0] % 2 == 0 and _covers(x, weight, bias)


def linear(x_TK: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias, one rounding; see `reference.linear`. Forward only (no autograd)."""
    _check("linear", x_TK, weight, bias)
    return gemm(x_TK, weight, bias, LINEAR)


def linear_add(x_TK: Tensor, weight: Tensor, bias: Tensor | None, residual_TN: Tensor,
               overwrite_input: bool = False) -> Tensor:
    """residual + x @ weight.T + bias; see `reference.linear_add`. `overwrite_input`: the sum is
    written into residual_TN (each program reads its residual tile before it stores over it)."""
    _check("linear_add", x_TK, weight, bias, residual_TN)
    if residual_TN.shape != (x_TK.shape[0], weight.shape[0]):
        raise InputError(f"triton linear_add: x {tuple(x_TK.shape)} @ weight.T {tuple(weight.shape[::-1])} does "
                         f"not match the residual {tuple(residual_TN.shape)}")
    return gemm(x_TK, weight, bias, ADD, residual=residual_TN, out=residual_TN if overwrite_input else None)


def linear_glu(x_TK: Tensor, weight: Tensor, bias: Tensor | None = None, act: str = "gelu") -> Tensor:
    """act(u[:, :F]) * u[:, F:] with u = x @ weight.T + bias, never written; see `reference.linear_glu`."""
    code = _code(act)  # an unknown activation raises ConfigError
    _check("linear_glu", x_TK, weight, bias)
    if weight.shape[0] % 2:
        raise InputError(f"triton linear_glu: weight has {weight.shape[0]} rows, expected input rows then as many "
                         "gate rows")
    return gemm(x_TK, weight, bias, GLU, act=code)
