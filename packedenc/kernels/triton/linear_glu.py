"""Gated MLP input projection, `linear_glu(x, weight, bias, act)`, as one Triton GEMM with the gate
in its epilogue: eager inference (ModernBERT's Wi + GeGLU).

Shapes: T packed tokens (M), D input width (K), F mlp width (weight is (2F, D): input rows, then gate rows).

What it replaces: the op's parts, cuBLAS's GEMM writing u (T, 2F) and `glu.py`'s kernel reading it
back (`reference.compose_linear_glu`, the table's last link for the calls this does not take). A
program computes a (BLOCK_M, BLOCK_F) tile of both halves, x @ W[n]^T and x @ W[n + F]^T, in two
fp32 accumulators; each is rounded (with its bias) to the dtype, as u would be, then act(u_in) *
u_gate in fp32 with one rounding (`reference.glu`): the parts' values, one launch and no u. It has
no backward: `covers_linear_glu` takes calls that need no gradient, on fp16 / bf16 row-major
operands, in eager CUDA execution; the op table (`kernels/auto.py`) says where it is chosen.

Rows past T and columns past F read row T - 1 / column F - 1 (in bounds, never stored), so the
loads need no mask; only a K that is not a multiple of BLOCK_K masks its last step.

The same kernel, with GATED off, is a plain projection (one accumulator, no gate): what
`layer_norm_linear.py` launches with the NORM prologue for the norm before an attention's Wqkv.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from packedenc.errors import InputError
from packedenc.kept import Kept, keepable
from packedenc.kernels.triton._common import cdiv, direct_launch, launch
from packedenc.kernels.triton.glu import _act, _code

__all__ = ["linear_glu", "covered_linear_glu", "covers_linear_glu", "linear_glu_fwd", "TILE", "layer_norm_linear_glu",
           "covered_layer_norm_linear_glu", "covers_layer_norm_linear_glu"]

_LOW = (torch.float16, torch.bfloat16)


@triton.jit
def _linear_glu_kernel(
    X,  # (M, K), row stride stride_x
    W,  # (2F, K): input rows, then gate rows; ungated (not GATED): (F, K)
    BIAS,  # (2F,) / (F,) (unread without HAS_BIAS)
    NW,  # (K,) LayerNorm weight of x's rows (unread without NORM)
    SW,  # (2F,) / (F,) fp32 column sums norm_weight W^T (unread without NORM): kept per weight, see `_colsums`
    OUT,  # (M, F)
    M, F, K,
    stride_x, stride_w, stride_o,
    eps,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,  # False: a plain projection x @ W^T + b, one accumulator (`layer_norm_linear`)
    NORM: tl.constexpr,  # x is the LayerNorm's input: normalise it on the way (see `layer_norm_linear_glu`)
    ACT: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for fp32 operands (full-precision dots: the CPU tests), else "tf32"
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # grouped order: GROUP_M row tiles share each column tile of W while it is in L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_f = tl.cdiv(F, BLOCK_F)
    width = GROUP_M * num_f
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_f = (pid % width) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rf = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
    rk = tl.arange(0, BLOCK_K)
    xm = tl.minimum(rm, M - 1).to(tl.int64)
    wf = tl.minimum(rf, F - 1).to(tl.int64)
    x_ptr = X + xm[:, None] * stride_x + rk[None, :]
    w_ptr = W + wf[:, None] * stride_w + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
    if GATED:
        g_ptr = w_ptr + F * stride_w
        acc_g = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
    if NORM:  # row sums of x and x^2
        s1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        s2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptr)
            b = tl.load(w_ptr)
            if GATED:
                bg = tl.load(g_ptr)
        else:
            kk = (rk < K - k * BLOCK_K)[None, :]
            a = tl.load(x_ptr, mask=kk, other=0.0)
            b = tl.load(w_ptr, mask=kk, other=0.0)
            if GATED:
                bg = tl.load(g_ptr, mask=kk, other=0.0)
        if NORM:
            gamma = tl.load(NW + k * BLOCK_K + rk, mask=rk < K - k * BLOCK_K, other=0.0).to(tl.float32)[None, :]
            af = a.to(tl.float32)
            s1 += tl.sum(af, 1)
            s2 += tl.sum(af * af, 1)
            a = (af * gamma).to(a.dtype)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        if GATED:
            acc_g = tl.dot(a, tl.trans(bg), acc_g, input_precision=PRECISION)
            g_ptr += BLOCK_K
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K

    dt = OUT.dtype.element_ty
    if NORM:  # LN(x) W^T = rstd * ((x * gamma) W^T - mean * (gamma W^T)), the norm without a bias
        mean = s1 / K
        rstd = tl.rsqrt(tl.maximum(s2 / K - mean * mean, 0.0) + eps)[:, None]
        mean = mean[:, None]
        acc = rstd * (acc - mean * tl.load(SW + wf)[None, :])
        if GATED:
            acc_g = rstd * (acc_g - mean * tl.load(SW + F + wf)[None, :])
    if HAS_BIAS:
        acc += tl.load(BIAS + wf).to(tl.float32)[None, :]
        if GATED:
            acc_g += tl.load(BIAS + F + wf).to(tl.float32)[None, :]
    if GATED:
        u, _ = _act(acc.to(dt).to(tl.float32), ACT)
        y = u * acc_g.to(dt).to(tl.float32)
    else:
        y = acc
    mask = (rm < M)[:, None] & (rf < F)[None, :]
    tl.store(OUT + rm.to(tl.int64)[:, None] * stride_o + rf[None, :], y.to(dt), mask=mask)


# (BLOCK_M, BLOCK_F, BLOCK_K, num_warps, num_stages); BLOCK_F per half (two accumulators). The
# fastest of five tiles on ModernBERT-base's Wi at T = 3,584 and 11,264 on an H100, alone and in
# whole eager forwards (history/linear_glu_probe_h100_5346266.json: its `glu-gemm-n128`).
TILE = (128, 128, 64, 8, 3)
# The ungated GEMM's (`layer_norm_linear`): one (128, 256) accumulator, the registers and shared
# memory of the gated tile's two (128, 128). With the NORM prologue the fastest of four tiles at
# Wqkv's shape, T = 3,584 and 11,264, on an H100 (history/linear_glu_probe_h100_debc2a6.json,
# `norm-wqkv-*` / `norm-gemm`; without the prologue (128, 128, 64, 8, 3) was faster).
TILE_LINEAR = (128, 256, 64, 8, 3)


def linear_glu_fwd(x_TK: Tensor, weight: Tensor, bias: Tensor | None, act: int | None,
                   tile: tuple[int, int, int, int, int] | None = None, norm_weight: Tensor | None = None,
                   eps: float = 1e-5) -> Tensor:
    """Launch the kernel: (T, F) from checked operands (`linear_glu`; with `norm_weight`, x's rows
    normalised first: `layer_norm_linear_glu`). `act` None: no gate, x @ W^T + b over all of W's
    rows (`layer_norm_linear`). `tile`: the probe's override of TILE / TILE_LINEAR."""
    T, K = x_TK.shape
    gated = act is not None
    F = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty((T, F), dtype=x_TK.dtype, device=x_TK.device)
    if T == 0 or F == 0:
        return out
    BM, BF, BK, warps, stages = tile or (TILE if gated else TILE_LINEAR)
    norm = norm_weight is not None
    launch(_linear_glu_kernel, (cdiv(T, BM) * cdiv(F, BF),), x_TK, weight, weight if bias is None else bias,
           norm_weight if norm else weight, _colsums(weight, norm_weight) if norm else weight, out,
           T, F, K, x_TK.stride(0), weight.stride(0), out.stride(0), float(eps),
           HAS_BIAS=bias is not None, GATED=gated, NORM=norm, ACT=act if gated else 0,
           PRECISION="ieee" if x_TK.dtype == torch.float32 else "tf32",
           EVEN_K=K % BK == 0, BLOCK_M=BM, BLOCK_F=BF, BLOCK_K=BK, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


# (id(weight), ...) -> norm_weight W^T: a model's layers, a few models at once
_COLSUMS = Kept(max_entries=256)


def _colsums(weight: Tensor, norm_weight: Tensor) -> Tensor:
    """(2F,) / (N,) fp32 sums of each weight row times the norm weight, which the epilogue scales by
    the rows' means. They depend on the weights only: made once and kept while both are the same
    tensors at the same versions (`packedenc.kept`), so the K loop reads only x, W and the norm
    weight and an eager call stays one launch; made per call where a value may not be kept (a
    CUDA-graph capture, which replays the launch; params made under inference_mode): one launch
    that reads W once in its dtype (`_rowdot_kernel`), no fp32 copy of W."""
    leaves = (weight, norm_weight)
    keep = keepable(leaves)
    hit = _COLSUMS.get(leaves) if keep else None
    if hit is not None:
        return hit
    N, K = weight.shape
    sums = torch.empty(N, dtype=torch.float32, device=weight.device)
    if N:
        launch(_rowdot_kernel, (cdiv(N, _ROWDOT_N),), weight, norm_weight, sums, N, K, weight.stride(0),
               BLOCK_N=_ROWDOT_N, BLOCK_K=_ROWDOT_K, num_warps=4)
    return _COLSUMS.put(leaves, None, sums) if keep else sums


_ROWDOT_N, _ROWDOT_K = 32, 128  # 72 programs at Wqkv's 2,304 rows: one pass over 3.5 MB


@triton.jit
def _rowdot_kernel(W, V, OUT, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """OUT[n] = sum over k of W[n, k] * V[k] in fp32, for this program's BLOCK_N rows."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = k0 + rk < K
        w = tl.load(W + rn.to(tl.int64)[:, None] * stride_w + (k0 + rk)[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0)
        v = tl.load(V + k0 + rk, mask=kmask, other=0.0)
        acc += w.to(tl.float32) * v.to(tl.float32)[None, :]
    tl.store(OUT + rn, tl.sum(acc, axis=1), mask=nmask)


def _layout(x: Tensor, weight: Tensor, bias: Tensor | None, gated: bool = True) -> str | None:
    """Why the kernel cannot take these operands (None: it can). Host values only."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or (gated and weight.shape[0] % 2):
        return (f"x {tuple(x.shape)} @ weight.T {tuple(weight.shape[::-1])}: expected (T, D) @ (D, "
                + ("2F), input rows then as many gate rows" if gated else "N)"))
    if bias is not None and bias.shape != (weight.shape[0],):
        return f"bias {tuple(bias.shape)} for {weight.shape[0]} weight rows"
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        return f"x, weight and bias must share a dtype, got {x.dtype} / {weight.dtype}" + (
            "" if bias is None else f" / {bias.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1 or (bias is not None and bias.stride(0) != 1):
        return "the operands' last dims must be contiguous"
    return None


def covers_linear_glu(x_TD: Tensor, weight: Tensor, bias: Tensor | None = None, act: str = "gelu") -> bool:
    """The calls this kernel takes: eager CUDA inference on fp16 / bf16 row-major operands."""
    return x_TD.dtype in _LOW and direct_launch(x_TD, weight, bias) and _layout(x_TD, weight, bias) is None


def linear_glu(x_TD: Tensor, weight: Tensor, bias: Tensor | None = None, act: str = "gelu") -> Tensor:
    """act(u[:, :F]) * u[:, F:] with u = x @ weight.T + bias, never written; see `reference.linear_glu`.

    Arguments:
        x_TD: (T, D). weight: (2F, D), input rows then gate rows. bias: (2F,) or None.
        act: an HF activation name; an unknown one raises ConfigError.
    Return:
        (T, F) in x's dtype. Forward only: an input that needs a gradient raises InputError.
    """
    code = _code(act)
    why = _unusable(x_TD, weight, bias)
    if why is not None:
        raise InputError(f"triton linear_glu: {why}")
    return linear_glu_fwd(x_TD, weight, bias, code)


def _unusable(x_TD: Tensor, *operands: Tensor | None, gated: bool = True) -> str | None:
    """Why the public functions refuse these operands (None: they take them): the layout of x,
    weight, bias, then the dtype, then a gradient that any of them needs."""
    why = _layout(x_TD, *operands[:2], gated=gated)
    if why is None and x_TD.dtype not in (*_LOW, torch.float32):
        why = f"expected float16, bfloat16 or float32, got {x_TD.dtype}"
    if why is None and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x_TD, *operands)):
        why = "forward only (no backward): call it under torch.no_grad() / inference_mode, or through the op table"
    return why


def covered_linear_glu(x_TD: Tensor, weight: Tensor, bias: Tensor | None = None, act: str = "gelu") -> Tensor:
    """The op table's entry: takes only the calls `covers_linear_glu` took (the table asks first), so
    the layout checks are not run twice on the eager path."""
    return linear_glu_fwd(x_TD, weight, bias, _code(act))


# ---- with the LayerNorm before it: layer_norm_linear_glu -------------------------------------------


def _norm_layout(x: Tensor, norm_weight: Tensor, norm_bias: Tensor | None) -> str | None:
    """Why the kernel cannot normalise x's rows with this norm (None: it can). Host values only."""
    if norm_bias is not None:
        return "a LayerNorm with a bias (ModernBERT's have none): the op's parts take it"
    if norm_weight.dim() != 1 or norm_weight.shape[0] != x.shape[-1]:
        return f"norm weight {tuple(norm_weight.shape)} for rows of {x.shape[-1]}"
    if norm_weight.dtype != x.dtype or norm_weight.stride(0) != 1:
        return f"norm weight must be contiguous in x's dtype {x.dtype}, got {norm_weight.dtype}"
    return None


def _norm_unusable(x_TD: Tensor, weight: Tensor, bias: Tensor | None, norm_weight: Tensor,
                   norm_bias: Tensor | None, gated: bool = True) -> str | None:
    """Why the public norm + GEMM functions refuse these operands (None: they take them): the GEMM's
    checks (`_unusable`), then the norm's (`_norm_layout`)."""
    why = _unusable(x_TD, weight, bias, norm_weight, gated=gated)
    return why if why is not None else _norm_layout(x_TD, norm_weight, norm_bias)


def covers_layer_norm_linear_glu(x_TD: Tensor, norm_weight: Tensor, norm_bias: Tensor | None, eps: float,
                                 weight: Tensor, bias: Tensor | None = None, act: str = "gelu") -> bool:
    """The calls this kernel takes: `covers_linear_glu`'s, with a LayerNorm without bias."""
    return (covers_linear_glu(x_TD, weight, bias, act) and direct_launch(norm_weight)
            and _norm_layout(x_TD, norm_weight, norm_bias) is None)


def layer_norm_linear_glu(x_TD: Tensor, norm_weight: Tensor, norm_bias: Tensor | None, eps: float,
                          weight: Tensor, bias: Tensor | None = None, act: str = "gelu") -> Tensor:
    """linear_glu(layer_norm(x), weight, bias, act) in one GEMM, the normalised rows never written;
    see `reference.layer_norm_linear_glu`.

    The program sums x's rows and squares as its tiles stream through the K loop and feeds the dot
    x * norm_weight (rounded to the dtype, where the parts round the normalised rows); the epilogue
    applies rstd * (acc - mean * (norm_weight W^T)). So the values differ from the parts' by the
    rounding of x * w instead of (x - mean) * rstd * w: the same size where the mean is small
    against the rows' spread (a pre-norm residual stream).

    Arguments: x_TD (T, D); norm_weight (D,), norm_bias None (a bias raises InputError), eps; the
    rest as `linear_glu`. Return: (T, F) in x's dtype. Forward only.
    """
    code = _code(act)
    why = _norm_unusable(x_TD, weight, bias, norm_weight, norm_bias)
    if why is not None:
        raise InputError(f"triton layer_norm_linear_glu: {why}")
    return linear_glu_fwd(x_TD, weight, bias, code, norm_weight=norm_weight, eps=eps)


def covered_layer_norm_linear_glu(x_TD: Tensor, norm_weight: Tensor, norm_bias: Tensor | None, eps: float,
                                  weight: Tensor, bias: Tensor | None = None, act: str = "gelu") -> Tensor:
    """The op table's entry for the calls `covers_layer_norm_linear_glu` took."""
    return linear_glu_fwd(x_TD, weight, bias, _code(act), norm_weight=norm_weight, eps=eps)
