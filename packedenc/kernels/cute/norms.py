"""LayerNorm and residual add + LayerNorm through quack's CuteDSL kernels (sm90+): the "cute" backend's norms.

Shapes: T packed tokens (rows), D hidden, P quack's persistent backward CTAs.

quack-kernels 0.6.5 (`quack.rmsnorm`, one kernel family for RMSNorm and LayerNorm):
- forward: `layernorm_fwd(x, w32, b32, eps, return_rstd=True, return_mean=True)` -> (y, rstd, mean),
  fp32 statistics (centred two-pass variance), one rounding; x (T, D) 2-D fp16 / bf16 / fp32.
  It asserts an fp32 weight and bias (see `_w32`).
- backward: `_rmsnorm_bwd(x, w32, dy, rstd, dx, dw_partial, db_partial, dresidual_out, None,
  mean=mean, is_layernorm=True)`, the op behind quack's public `layernorm_bwd`, called directly for
  its `dresidual_out`: the gradient reaching the LayerNorm input from elsewhere (add_layer_norm's
  returned sum) is added to dx inside the kernel. dweight / dbias come back as (P, D) fp32 partials
  per CTA, summed here in one torch reduction: deterministic, no atomics.

Residual add: quack's fused residual (`_rmsnorm_fwd(..., residual=...)`) takes its statistics from
the fp32 sum and rounds only the sum it stores; `reference.add_layer_norm` rounds x + residual to
the activation dtype *before* the statistics (two eager ops' semantics, which the Triton kernel
keeps). So `add_layer_norm` here adds with torch (the same rounding as the reference, bit for bit)
and normalises that sum with quack; the backward is quack's alone (dsum fused). `x_bias` is not
taken (quack has no pre-residual bias): the table sends those calls to the next choice.

Each op is a `torch.library` custom op (CPU: the reference, so CPU CI checks registration, opcheck
and autograd; CUDA: quack, imported lazily; a fake; a registered backward). In eager CUDA the entries
skip the custom-op dispatcher as the Triton norms do (`triton/_common.direct_launch`,
`eager_autograd`): its host time is larger than these kernels' GPU time on short batches.

Compile cost: quack compiles each kernel variant on first use (per dtype, D, bias or not; the
backward also per power-of-two bucket of T) and caches it on disk. Warm up before CUDA-graph capture.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from packedenc.errors import InputError
from packedenc.kernels import reference
from packedenc.kernels.reference import backward as reference_bwd
from packedenc.kernels.triton._common import direct_launch, eager_autograd, eager_cuda, launch_or_op

__all__ = ["layer_norm", "add_layer_norm", "covers_layer_norm", "covers_add_layer_norm", "MIN_HIDDEN",
           "MAX_HIDDEN", "MIN_CAPABILITY"]

MIN_CAPABILITY = (9, 0)  # quack's norms use thread-block clusters (sm90+); older GPUs go to triton
MIN_HIDDEN, MAX_HIDDEN = 256, 8192  # quack's own tests start near 256; up to 8192 a row needs no cluster
_ACT_DTYPES = (torch.float16, torch.bfloat16)
_PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_F32 = torch.float32


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)  # a host query, cached: no device sync


def _covers(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    D = x.shape[-1]
    return (
        x.is_cuda
        and x.dtype in _ACT_DTYPES
        and x.stride(-1) == 1
        and D % 8 == 0  # 16-byte rows: quack's vector copies at full width
        and MIN_HIDDEN <= D <= MAX_HIDDEN
        and weight.dtype in _PARAM_DTYPES and tuple(weight.shape) == (D,) and weight.is_cuda
        and (bias is None or (bias.dtype in _PARAM_DTYPES and tuple(bias.shape) == (D,) and bias.is_cuda))
        and _capability(x.device.index if x.device.index is not None else torch.cuda.current_device())
        >= MIN_CAPABILITY
    )


def covers_layer_norm(x_TD: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> bool:
    """The layer_norm calls quack takes (host values only): CUDA fp16 / bf16 x with a contiguous
    last dim D, D % 8 == 0 and MIN_HIDDEN <= D <= MAX_HIDDEN, a (D,) weight and bias, an sm90+ device."""
    return _covers(x_TD, weight, bias)


def covers_add_layer_norm(x_TD: Tensor, residual_TD: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
                          x_bias: Tensor | None = None, keep_sum: bool = True, overwrite_input: bool = False) -> bool:
    """`covers_layer_norm`'s calls with a residual of x's shape and dtype and no x_bias."""
    return (x_bias is None and residual_TD.is_cuda and residual_TD.dtype == x_TD.dtype
            and residual_TD.shape == x_TD.shape and _covers(x_TD, weight, bias))


# ---- the CUDA launchers ---------------------------------------------------------------------------


def _rows(t: Tensor) -> Tensor:
    """t as (rows, D), contiguous and 16-byte aligned: quack compiles for a unit last stride and
    16-byte vectors, and a view at an odd offset would fault. Copies only when needed."""
    t2 = t.reshape(-1, t.shape[-1])
    if not t2.is_contiguous() or t2.data_ptr() % 16:
        t2 = t2.clone(memory_format=torch.contiguous_format)
    return t2


def _w32(t: Tensor | None) -> Tensor | None:
    # quack's layernorm_fwd asserts an fp32 weight and bias, and the backward gets the same ones (the
    # variant quack tests and benchmarks/cute.py measured). Params are usually bf16: a D-element cast
    # per call. An fp32 param is used as is unless it is a strided or misaligned view.
    if t is None:
        return None
    t = t.to(_F32)
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def _norm_cuda(x: Tensor, residual: Tensor | None, weight: Tensor, bias: Tensor | None, eps: float,
               need_stats: bool) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """(y, the LayerNorm input s: x or the rounded x + residual, (mean, rstd) (T,) fp32 or None)."""
    from quack.rmsnorm import layernorm_fwd

    s = x if residual is None else torch.add(x, residual)  # rounds like the reference's x + residual
    out = layernorm_fwd(_rows(s), _w32(weight), _w32(bias), eps, return_rstd=need_stats, return_mean=need_stats)
    if not need_stats:
        return out.view(s.shape), s, None
    y, rstd, mean = out
    return y.view(s.shape), s, (mean, rstd)


def _fwd_cuda(x: Tensor, residual: Tensor | None, weight: Tensor, bias: Tensor | None, eps: float,
              need_stats: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op's outputs: (y, rounded x + residual or an empty tensor, mean, rstd or empty tensors)."""
    y, s, stats = _norm_cuda(x, residual, weight, bias, eps, need_stats)
    mean, rstd = stats if stats is not None else (x.new_empty(0, dtype=_F32), x.new_empty(0, dtype=_F32))
    return y, (s if residual is not None else x.new_empty(0)), mean, rstd


def _bwd_cuda(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, dsum: Tensor | None,
              has_bias: bool) -> tuple[Tensor, Tensor]:
    """(dx + dsum in x's dtype, (1 + has_bias, D) fp32 sums: dweight, then dbias): quack's backward."""
    from quack.rmsnorm import _rmsnorm_bwd
    from quack.rmsnorm_config import get_sm_count

    x2, D = _rows(x), x.shape[-1]
    dx = torch.empty_like(x2)
    if x2.shape[0] == 0:  # quack returns before writing its partials
        return dx.view(x.shape), x2.new_zeros((1 + has_bias, D), dtype=_F32)
    P = get_sm_count(D, x.device)  # quack's own persistent grid (host properties, cached by torch)
    part = torch.empty((1 + has_bias, P, D), device=x.device, dtype=_F32)  # one buffer: one sum below
    _rmsnorm_bwd(x2, _w32(weight), _rows(dy), rstd, dx, part[0], part[1] if has_bias else None,
                 None if dsum is None else _rows(dsum), None, P, mean=mean, is_layernorm=True)
    return dx.view(x.shape), part.sum(1)


# ---- the registered ops ---------------------------------------------------------------------------


def _stats(s: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(mean, rstd) of each row of s in fp32: what quack's forward returns (its backward reads them)."""
    s32 = s.reshape(-1, s.shape[-1]).float()
    mean = s32.mean(-1)
    return mean, torch.rsqrt((s32 - mean[:, None]).square().mean(-1) + eps)


@torch.library.custom_op("packedenc::quack_layer_norm_fwd", mutates_args=(), device_types="cpu")
def _fwd(x: Tensor, residual: Tensor | None, weight: Tensor, bias: Tensor | None, eps: float,
         need_stats: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if residual is None:
        y, s = reference.layer_norm(x, weight, bias, eps), x.new_empty(0)
    else:
        y, s = reference.add_layer_norm(x, residual, weight, bias, eps)
    if need_stats:
        mean, rstd = _stats(x if residual is None else s, eps)
    else:  # two tensors: a custom op's outputs must not alias each other
        mean, rstd = x.new_empty(0, dtype=_F32), x.new_empty(0, dtype=_F32)
    return y, s, mean, rstd


@_fwd.register_kernel("cuda")
def _(x, residual, weight, bias, eps, need_stats):
    return _fwd_cuda(x, residual, weight, bias, eps, need_stats)


@_fwd.register_fake
def _(x, residual, weight, bias, eps, need_stats):
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    T = x.numel() // x.shape[-1] if need_stats else 0
    s = x.new_empty(0) if residual is None else x.new_empty(x.shape, dtype=dtype)
    return x.new_empty(x.shape, dtype=dtype), s, x.new_empty(T, dtype=_F32), x.new_empty(T, dtype=_F32)


@torch.library.custom_op("packedenc::quack_layer_norm_bwd", mutates_args=(), device_types="cpu")
def _bwd(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, dsum: Tensor | None, eps: float,
         has_bias: bool) -> tuple[Tensor, Tensor]:
    # the CPU recomputes the statistics; an fp32 weight keeps the sums unrounded, as quack's are
    dx, dw, db = reference_bwd.layer_norm_bwd(dy, x, weight.float(), eps, dsum)
    return dx.reshape(x.shape), torch.stack([dw, db][: 1 + has_bias])


@_bwd.register_kernel("cuda")
def _(dy, x, weight, mean, rstd, dsum, eps, has_bias):
    return _bwd_cuda(dy, x, weight, mean, rstd, dsum, has_bias)


@_bwd.register_fake
def _(dy, x, weight, mean, rstd, dsum, eps, has_bias):
    return torch.empty_like(x), x.new_empty((1 + has_bias, x.shape[-1]), dtype=_F32)


def _bwd_launch(dy, x, weight, mean, rstd, dsum, eps, has_bias):
    return _bwd_cuda(dy, x, weight, mean, rstd, dsum, has_bias)  # eps: the statistics are saved


def _setup(ctx, inputs, output):
    x, residual, weight, bias, eps, need_stats = inputs
    y, s, mean, rstd = output
    ctx.save_for_backward(x if residual is None else s, weight, mean, rstd)  # the LayerNorm input
    ctx.eps, ctx.need_stats = eps, need_stats
    ctx.dtypes = (x.dtype, None if residual is None else residual.dtype, weight.dtype,
                  None if bias is None else bias.dtype)
    # An unused output (the final norm's sum, the statistics) gets None, not a zero-filled gradient.
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dsum, dmean, drstd):
    s, weight, mean, rstd = ctx.saved_tensors
    x_dtype, res_dtype, w_dtype, b_dtype = ctx.dtypes
    if res_dtype is None:  # layer_norm's placeholder sum: AOT autograd may hand it a (0,) zero gradient
        dsum = None
    dw = db = None
    if dy is None and dsum is None:
        return None, None, None, None, None, None
    if dy is None:  # only the sum is used: the LayerNorm contributes nothing
        ds = dsum
    else:
        if not ctx.need_stats:
            raise RuntimeError("cute layer_norm: backward of a forward run without statistics "
                               "(inputs that required no gradient)")
        ds, sums = launch_or_op(_bwd_launch, torch.ops.packedenc.quack_layer_norm_bwd, dy, s, weight, mean, rstd,
                                dsum, ctx.eps, b_dtype is not None)
        dw = sums[0].to(w_dtype)
        db = sums[1].to(b_dtype) if b_dtype is not None else None
    if res_dtype is None:
        return ds, None, dw, db, None, None
    return ds.to(x_dtype), ds.to(res_dtype), dw, db, None, None


_fwd.register_autograd(_backward, setup_context=_setup)
_fwd_eager = eager_autograd(_fwd_cuda, _setup, _backward)


def _fwd_any(x, residual, weight, bias, eps):
    """The forward through the fastest path that is correct here: direct launch (eager inference),
    the eager autograd function (eager training), else the registered op (compile, CPU)."""
    tensors = (x, residual, weight, bias)
    if direct_launch(*tensors):
        return _norm_cuda(x, residual, weight, bias, eps, False)
    need_stats = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if eager_cuda(*tensors):
        return _fwd_eager(x, residual, weight, bias, eps, need_stats)
    return torch.ops.packedenc.quack_layer_norm_fwd(x, residual, weight, bias, eps, need_stats)


# ---- the Ops-table entries: reference signatures --------------------------------------------------


def layer_norm(x_TD: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """LayerNorm over the last dim on quack's kernels: fp32 statistics, one rounding (see
    `reference.layer_norm`). CUDA inputs outside `covers_layer_norm` raise InputError; on the CPU
    the op runs the reference."""
    if x_TD.is_cuda and not covers_layer_norm(x_TD, weight, bias, eps):
        raise InputError(f"cute layer_norm: quack needs CUDA fp16 / bf16 x with a contiguous last dim D, "
                         f"D % 8 == 0 and {MIN_HIDDEN} <= D <= {MAX_HIDDEN}, a (D,) weight / bias and an sm90+ GPU; got x "
                         f"{x_TD.dtype} {tuple(x_TD.shape)} stride {x_TD.stride()}, weight {weight.dtype} "
                         f"{tuple(weight.shape)} on {x_TD.device}")
    return _fwd_any(x_TD, None, weight, bias, eps)[0]


def add_layer_norm(
    x_TD: Tensor, residual_TD: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
    x_bias: Tensor | None = None, keep_sum: bool = True, overwrite_input: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(LayerNorm(x + residual), x + residual): the sum rounded to x's dtype before the statistics,
    as in `reference.add_layer_norm` (torch adds, quack normalises; the backward is quack's with the
    sum's gradient fused). No `x_bias`: those calls, and CUDA inputs outside `covers_add_layer_norm`,
    raise InputError (the op table sends them to the next choice). `keep_sum` False returns (y, None);
    `overwrite_input` is allowed and ignored (quack allocates its outputs)."""
    if x_bias is not None or (x_TD.is_cuda and not covers_add_layer_norm(x_TD, residual_TD, weight, bias, eps)):
        raise InputError(f"cute add_layer_norm: quack takes no x_bias, and needs a residual of x's shape and dtype "
                         f"besides what layer_norm needs; got x {x_TD.dtype} {tuple(x_TD.shape)}, residual "
                         f"{residual_TD.dtype} {tuple(residual_TD.shape)}, x_bias "
                         f"{None if x_bias is None else tuple(x_bias.shape)} on {x_TD.device}")
    y, s = _fwd_any(x_TD, residual_TD, weight, bias, eps)[:2]
    return y, s if keep_sum else None
