"""The Triton varlen attention as a registered op with a backward, and its Ops-table entries.

Shapes: T packed tokens, S sequences, H heads, K head dim.

One `triton_op`, `packedenc::triton_varlen_attention`, for two input layouts: separate q, k, v
(T, H, K) views (ModernBERT, BERT), or, with k = v = None, one fused (T, 3, H, K) qkv buffer (the
graph transformer), whose gradient then comes back as one (T, 3, H, K) tensor, so the projection
GEMM's backward reads it without a stack. Either way the kernels read the views in place (any row
and head strides, head dim contiguous). CPU: the reference (and `reference.backward`); CUDA: the
kernels of attention.py / attention_bwd.py, forward and backward. The forward writes the softmax
statistics (LSE2) only when autograd will need them.

Eager CUDA inference skips the op (`direct_launch`: the dispatcher costs tens of microseconds per
call, which decides short batches), and eager CUDA training runs it as an autograd.Function around
the same launchers (`eager_autograd`); torch.compile, functorch and the CPU go through the op. The
backward is always the Triton dQ and dK/dV kernels.

Entries (reference signatures): `varlen_attention` (every input it is given, or a clear error:
there is no hand-off to another library), `graph_attention` for the inputs `covers_graph`
accepts and `rotary_attention` (RoPE applied as the forward reads q and k) for those
`covers_rotary_attention` accepts; the op table routes the rest, visibly (kernels/__init__.py).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op

from packedenc.errors import InputError
from packedenc.kernels import reference
from packedenc.kernels.graph_attention import fold_key_bias_qkv
from packedenc.kernels.reference import backward as reference_bwd
from packedenc.kernels.triton._common import direct_launch, eager_autograd, eager_cuda, launch_or_op
from packedenc.kernels.triton.attention import MAX_HEAD_DIM, SHORT_SEQLEN, attention_fwd, rope_table
from packedenc.kernels.triton.attention_bwd import attention_bwd
from packedenc.kernels.triton.rotary import _inv_freq

__all__ = ["varlen_attention", "graph_attention", "covers_graph", "attention", "check_inputs",
           "rotary_attention", "covers_rotary_attention"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _split(q: Tensor, k: Tensor | None, v: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    return q.unbind(1) if k is None else (q, k, v)


# ---- the registered op ---------------------------------------------------------------------------


def _fwd_cuda(q, k, v, cu_seqlens, max_seqlen, left, right, scale, lse):
    out, lse2 = attention_fwd(*_split(q, k, v), cu_seqlens, max_seqlen, (left, right), scale, lse=lse)
    return out, lse2 if lse else q.new_empty((0,), dtype=torch.float32)


@triton_op("packedenc::triton_varlen_attention", mutates_args=())
def _fwd(q: Tensor, k: Tensor | None, v: Tensor | None, cu_seqlens: Tensor, max_seqlen: int, left: int,
         right: int, scale: float, lse: bool) -> tuple[Tensor, Tensor]:
    if q.is_cuda:
        return _fwd_cuda(q, k, v, cu_seqlens, max_seqlen, left, right, scale, lse)
    qs, ks, vs = _split(q, k, v)
    out = reference.varlen_attention(qs, ks, vs, cu_seqlens, max_seqlen, (left, right), scale).contiguous()
    # The CPU backward recomputes the probabilities (reference_bwd): this LSE2 is never read.
    return out, q.new_zeros((qs.shape[1], qs.shape[0]) if lse else (0,), dtype=torch.float32)


def _bwd_cuda(do, q, k, v, out, lse, cu_seqlens, max_seqlen, left, right, scale):
    return attention_bwd(do, *_split(q, k, v), out, lse, cu_seqlens, max_seqlen, (left, right), scale,
                         fused_qkv=k is None)


@triton_op("packedenc::triton_varlen_attention_bwd", mutates_args=())
def _bwd(do: Tensor, q: Tensor, k: Tensor | None, v: Tensor | None, out: Tensor, lse: Tensor,
         cu_seqlens: Tensor, max_seqlen: int, left: int, right: int, scale: float) -> Tensor:
    """dq, dk, dv as one tensor: (T, 3, H, K) for a fused qkv input, else (3, T, H, K)."""
    if do.is_cuda:
        return _bwd_cuda(do, q, k, v, out, lse, cu_seqlens, max_seqlen, left, right, scale)
    grads = reference_bwd.varlen_attention_bwd(do, *_split(q, k, v), cu_seqlens, (left, right), scale)
    return torch.stack(grads, 1 if k is None else 0)


def _setup(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, left, right, scale, lse = inputs
    out, lse2 = output
    ctx.save_for_backward(q, k, v, out, lse2, cu_seqlens)
    ctx.args = (max_seqlen, left, right, scale, lse)
    ctx.mark_non_differentiable(lse2)
    # No zero-filled (H, T) gradient for the LSE: autograd would make one (and launch a fill) for
    # every attention backward of every layer
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse2, cu_seqlens = ctx.saved_tensors
    max_seqlen, left, right, scale, lse = ctx.args
    assert lse, "triton_varlen_attention: the forward was run without lse=True, so it has no backward"
    g = launch_or_op(_bwd_cuda, torch.ops.packedenc.triton_varlen_attention_bwd, dout, q, k, v, out, lse2,
                     cu_seqlens, max_seqlen, left, right, scale)
    grads = (g, None, None) if k is None else g.unbind(0)
    return (*grads, None, None, None, None, None, None)


_fwd.register_autograd(_backward, setup_context=_setup)
_fwd_eager = eager_autograd(_fwd_cuda, _setup, _backward)


# ---- checks and the entries ----------------------------------------------------------------------


def check_inputs(q: Tensor, k: Tensor | None, v: Tensor | None, cu_seqlens: Tensor, scale: float | None) -> float:
    """Raise InputError naming the bad argument; return the scale (default K ** -0.5)."""
    fused = k is None
    want = 4 if fused else 3
    if q.dim() != want or (fused and q.shape[1] != 3):
        what = "(T, 3, H, K) fused qkv" if fused else "(T, H, K)"
        raise InputError(f"varlen_attention: q must be {what}, got shape {tuple(q.shape)}")
    if not fused and (k.shape != q.shape or v.shape != q.shape):
        raise InputError(f"varlen_attention: q, k, v shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.dtype not in _FLOATS or (not fused and not (k.dtype == v.dtype == q.dtype)):
        got = q.dtype if fused else (q.dtype, k.dtype, v.dtype)
        raise InputError(f"varlen_attention: q, k, v must share one of float16, bfloat16, float32; got {got}")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise InputError(f"varlen_attention: the Triton kernel takes head dims <= {MAX_HEAD_DIM}, got "
                         f"{q.shape[-1]}; use backend='reference'")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.device != q.device:
        raise InputError(f"varlen_attention: cu_seqlens must be (S + 1,) int32 on {q.device}, got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)} on {cu_seqlens.device}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not scale > 0:  # the kernels fold the scale into the running max, which needs scale > 0
        raise InputError(f"varlen_attention: scale must be > 0, got {scale}")
    return scale


def attention(q: Tensor, k: Tensor | None, v: Tensor | None, cu_seqlens: Tensor, max_seqlen: int,
              window: tuple[int, int] = (-1, -1), scale: float | None = None) -> Tensor:
    """(T, H, K) attention of separate q, k, v views or (k = v = None) a fused (T, 3, H, K) buffer."""
    scale = check_inputs(q, k, v, cu_seqlens, scale)
    if q.stride(-1) != 1:  # head dim contiguous; other strides are free
        q = q.contiguous()
    if k is not None:
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
    if not cu_seqlens.is_contiguous():
        cu_seqlens = cu_seqlens.contiguous()
    left, right = int(window[0]), int(window[1])
    if direct_launch(q, k, v):
        return attention_fwd(*_split(q, k, v), cu_seqlens, max_seqlen, (left, right), scale, lse=False)[0]
    need = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v))
    if eager_cuda(q, k, v):  # eager training: the same kernels without the custom-op dispatcher
        return _fwd_eager(q, k, v, cu_seqlens, max_seqlen, left, right, scale, need)[0]
    return torch.ops.packedenc.triton_varlen_attention(q, k, v, cu_seqlens, max_seqlen, left, right, scale, need)[0]


def varlen_attention(
    q_THK: Tensor,
    k_THK: Tensor,
    v_THK: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
) -> Tensor:
    """Non-causal varlen attention with an FA window on the Triton kernels, forward and backward.

    Same signature and semantics as `reference.varlen_attention`.

    Arguments:
        q_THK, k_THK, v_THK: (T, H, K) packed, float16 / bfloat16 / float32, K <= 256; any row and
            head strides (slices of a fused qkv buffer are read in place).
        cu_seqlens: (S+1,) int32 on q's device. max_seqlen: host int >= the longest sequence.
        window: (left, right), query i sees keys i - left .. i + right, -1 unbounded.
        scale: softmax scale > 0, default K ** -0.5.
    Return:
        (T, H, K) in q's dtype; fp32 softmax; a token never sees another sequence. Differentiable
        (the Triton backward); dq, dk, dv come back contiguous.
    """
    return attention(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window, scale)


_LOWP = (torch.float16, torch.bfloat16)


def covers_graph(q_QHK: Tensor, k_THK: Tensor | None, v_THK: Tensor | None, cu_seqlens_q: Tensor,
                 cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, key_bias_TH: Tensor | None = None,
                 scale: float | None = None) -> bool:
    """The graph_attention calls the Triton kernel takes (host values only): full layers given as one
    fused qkv buffer (query boundaries = key boundaries; the anchor-only layer has its own), fp16 /
    bf16 (fp32 would run the dots without tensor cores), head dim + the folded bias column <= 256."""
    return (k_THK is None and q_QHK.dtype in _LOWP
            and q_QHK.shape[-1] + (key_bias_TH is not None) <= MAX_HEAD_DIM)


def graph_attention(
    q_QHK: Tensor,
    k_THK: Tensor | None,
    v_THK: Tensor | None,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    key_bias_TH: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """`reference.graph_attention` for the calls `covers_graph` accepts: a full layer's fused
    (T, 3, H, K) qkv buffer; GiGL's key bias folded into the head dim (`fold_key_bias_qkv`, exact).

    Return: (T, H, K) in qkv's dtype; the gradient of the buffer is one (T, 3, H, K) tensor.
    """
    if k_THK is not None or v_THK is not None:
        raise InputError("graph_attention (triton): takes a full layer's fused (T, 3, H, K) qkv buffer "
                         "with k = v = None; the op table routes other calls elsewhere")
    K = q_QHK.shape[-1]
    scale = K**-0.5 if scale is None else scale
    if cu_seqlens_k.dtype != torch.int32:
        cu_seqlens_k = cu_seqlens_k.to(torch.int32)
    qkv = q_QHK if key_bias_TH is None else fold_key_bias_qkv(q_QHK, key_bias_TH, scale)
    out = attention(qkv, None, None, cu_seqlens_k, max_seqlen_k, (-1, -1), scale)
    return out if key_bias_TH is None else out[..., :K]


# ---- RoPE read inside the forward (inference on short sequences) -----------------------------------


_ROPE_TABLES: dict[tuple, Tensor] = {}


def _rope_table(inv_freq: Tensor, theta: float, scaling: float, dtype: torch.dtype) -> Tensor:
    """`attention.rope_table` for positions below SHORT_SEQLEN (those of every call the fused
    forward covers; a larger position is computed in the kernel), cached per model setting."""
    key = (inv_freq.shape[0], float(theta), scaling, dtype, inv_freq.device)
    table = _ROPE_TABLES.get(key)
    if table is None:
        table = rope_table(inv_freq, SHORT_SEQLEN, scaling, dtype)
        if not (inv_freq.is_cuda and torch.cuda.is_current_stream_capturing()):  # not the graph pool's memory
            _ROPE_TABLES[key] = table
    return table


def covers_rotary_attention(qkv_T3HK: Tensor, positions_T: Tensor, theta: float, cu_seqlens: Tensor,
                            max_seqlen: int, window: tuple[int, int] = (-1, -1), scale: float | None = None,
                            scaling: float = 1.0, overwrite_input: bool = False, **attention_kwargs) -> bool:
    """The rotary_attention calls the fused forward takes (host values only): eager inference on
    CUDA (it has no backward), sequences of at most SHORT_SEQLEN tokens (a key tile is rotated once
    per query block that reads it: two or three times on short packs, tens of times over a long
    sequence), no attention dropout, an even head dim. The table sends the rest to rotary, then
    varlen_attention."""
    return (not attention_kwargs and max_seqlen <= SHORT_SEQLEN and qkv_T3HK.dim() == 4
            and qkv_T3HK.shape[-1] % 2 == 0 and direct_launch(qkv_T3HK))


def rotary_attention(qkv_T3HK: Tensor, positions_T: Tensor, theta: float, cu_seqlens: Tensor, max_seqlen: int,
                     window: tuple[int, int] = (-1, -1), scale: float | None = None, scaling: float = 1.0,
                     overwrite_input: bool = False) -> Tensor:
    """`reference.rotary_attention` in one kernel: the forward rotates q and k as it reads them
    from the (T, 3, H, K) qkv buffer (no rotated copy, no rotary launch). qkv is only read, unless
    `overwrite_input`: the output then goes into qkv's q slot (no allocation).

    Return: (T, H, K) in qkv's dtype (with `overwrite_input`, a view of qkv with row stride 3 H K).
    No gradient: `covers_rotary_attention` keeps training away.
    """
    if qkv_T3HK.dim() != 4 or qkv_T3HK.shape[1] != 3 or qkv_T3HK.shape[-1] % 2:
        raise InputError(f"rotary_attention: qkv must be (T, 3, H, K) with an even K, got {tuple(qkv_T3HK.shape)}")
    q, k, v = qkv_T3HK.unbind(1)
    scale = check_inputs(q, k, v, cu_seqlens, scale)
    T = q.shape[0]
    if (positions_T.shape != (T,) or positions_T.is_floating_point() or positions_T.dtype == torch.bool
            or positions_T.device != q.device):
        raise InputError(f"rotary_attention: positions must be ({T},) integers on {q.device}, got "
                         f"{positions_T.dtype} {tuple(positions_T.shape)} on {positions_T.device}")
    if q.stride(-1) != 1:
        q, k, v = (t.contiguous() for t in (q, k, v))
    if not cu_seqlens.is_contiguous():
        cu_seqlens = cu_seqlens.contiguous()
    inv_freq = _inv_freq(q.shape[-1], theta, q.device)
    rope = (positions_T.contiguous(), inv_freq, _rope_table(inv_freq, theta, float(scaling), q.dtype), float(scaling))
    return attention_fwd(q, k, v, cu_seqlens, max_seqlen, (int(window[0]), int(window[1])), scale, lse=False,
                         rope=rope, out=q if overwrite_input else None)[0]
