"""torch's and flash-attn's attention kernels: the only module that knows their varlen signatures.

Shapes: Q packed queries, T packed tokens (keys), S sequences, H heads, K head dim.

Registered as the "flash" backend: `varlen_attention` (for the inputs `covers_varlen` accepts:
CUDA, fp16 / bf16, head dims that are multiples of 8 up to 256; the op table routes the rest) and
`graph_attention` (torch's aten efficient / flash kernels, every input).

## varlen_attention

Every implementation has `reference.varlen_attention`'s signature
`(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window=(-1, -1), scale=None)`, with FA's window
convention (query i sees keys i - left .. i + right, -1 unbounded; ModernBERT local = (64, 64)):

- "torch": `torch.nn.attention.varlen.varlen_attn(..., scale=, window_size=)` (torch >= 2.11; its
  own custom op with autograd, torch's bundled FA2). It is `torch-flash` in
  benchmarks/results/attention_h200.json.
- "aten": `aten._flash_attention_forward/_backward` with `window_size_left/right` (torch 2.9,
  2.10), wrapped here in the custom ops `packedenc::flash_varlen_fwd/_bwd` with autograd. Their
  CPU implementation is the reference, so CPU CI exercises registration, compile and autograd.
- "fa2": `flash_attn.flash_attn_varlen_func` (the flash-attn 2.x package), when installed.

`varlen_attention` runs the first of `ORDER` that this torch / install offers (`CHOSEN`): torch's
own varlen op first (the one measured, a registered op torch maintains), then the aten wrapper
for torch 2.9 / 2.10, then the flash-attn 2 package for a torch with neither: the same FA2 kernels
each time, so the order is about support, not speed. FlashAttention-4 is the "cute" backend
(`kernels/cute/`), chosen in the op table, never here. To run one implementation, replace the
table entry: `dataclasses.replace(packedenc.get_ops("auto", "cuda"), varlen_attention=flash.IMPLS["aten"])`.

## graph_attention
One *core* runs each call (`core=`, default "efficient"):
- "efficient": `aten._efficient_attention_forward/_backward` (cutlass memory-efficient), any
  dtype, own query / key boundaries (the anchor-only last layer). With a fused qkv buffer its
  backward allocates dq, dk, dv as slices of one (T, 3, H, K) tensor (`shared_storage_dqdkdv`),
  returned as the gradient of the buffer: no stack of three gradients, no strided copies.
- "flash": `aten._flash_attention_forward` (FA2 inside torch), fp16 / bf16, head dim <= 256.
GiGL's key bias is folded into the head dim (`kernels/graph_attention.py`), padded to a multiple
of 8 (the kernels' alignment).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from typing import Callable

import torch
from torch import Tensor

from packedenc.errors import InputError
from packedenc.kernels import reference, register_impl
from packedenc.kernels.graph_attention import fold_key_bias, fold_key_bias_qkv, pad_head_dim
from packedenc.kernels.reference import backward as reference_bwd

__all__ = ["varlen_attention", "covers_varlen", "graph_attention", "efficient_qkv_attention",
           "aten_graph_attention", "GRAPH_CORES", "IMPLS", "ORDER", "CHOSEN"]

log = logging.getLogger("packedenc")


def covers_varlen(q_THK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                  window: tuple[int, int] = (-1, -1), scale: float | None = None) -> bool:
    """The varlen_attention calls flash kernels take (host values only)."""
    K = q_THK.shape[-1]
    return (
        q_THK.is_cuda
        and q_THK.dtype in (torch.float16, torch.bfloat16)
        and k_THK.dtype == q_THK.dtype == v_THK.dtype
        and K % 8 == 0
        and K <= 256
    )


# ---- torch >= 2.11 ----------------------------------------------------------------------------


def _find_torch_varlen() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn if "window_size" in params and "scale" in params else None  # 2.10 has neither


_VARLEN_ATTN = _find_torch_varlen()


def torch_varlen_attention(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window=(-1, -1), scale=None):
    return _VARLEN_ATTN(
        q_THK, k_THK, v_THK, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        scale=scale, window_size=(int(window[0]), int(window[1])),
    )


# ---- aten (torch 2.9 / 2.10), our own custom op -------------------------------------------------


def _aten_has_window() -> bool:
    try:
        schema = torch.ops.aten._flash_attention_forward.default._schema
    except (AttributeError, RuntimeError):
        return False
    return any(a.name == "window_size_left" for a in schema.arguments)


@torch.library.custom_op("packedenc::flash_varlen_fwd", mutates_args=(), device_types="cpu")
def _flash_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, left: int, right: int,
    scale: float | None,
) -> tuple[Tensor, Tensor]:
    out = reference.varlen_attention(q, k, v, cu_seqlens, max_seqlen, (left, right), scale)
    # The CPU backward recomputes the probabilities; this lse is never read.
    return out, q.new_zeros((q.shape[1], q.shape[0]), dtype=torch.float32)


@_flash_fwd.register_kernel("cuda")
def _(q, k, v, cu_seqlens, max_seqlen, left, right, scale):
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, False, False,
        scale=scale, window_size_left=left, window_size_right=right,
    )
    return out, lse


@_flash_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, left, right, scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("packedenc::flash_varlen_bwd", mutates_args=(), device_types="cpu")
def _flash_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
    max_seqlen: int, left: int, right: int, scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = reference_bwd.varlen_attention_bwd(do, q, k, v, cu_seqlens, (left, right), scale)
    return dq, dk, dv


@_flash_bwd.register_kernel("cuda")
def _(do, q, k, v, out, lse, cu_seqlens, max_seqlen, left, right, scale):
    rng = torch.zeros((2,), dtype=torch.uint64, device=q.device)  # dropout is 0: never read
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        do.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        0.0, False, rng, unused, scale=scale, window_size_left=left, window_size_right=right,
    )
    return dq, dk, dv


@_flash_bwd.register_fake
def _(do, q, k, v, out, lse, cu_seqlens, max_seqlen, left, right, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_setup(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, left, right, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)
    ctx.args = (max_seqlen, left, right, scale)


def _fwd_backward(ctx, do, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = torch.ops.packedenc.flash_varlen_bwd(do, q, k, v, out, lse, cu_seqlens, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


_flash_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


def aten_varlen_attention(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window=(-1, -1), scale=None):
    left, right = int(window[0]), int(window[1])
    return torch.ops.packedenc.flash_varlen_fwd(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, left, right, scale)[0]


# ---- flash-attn 2 (optional install) --------------------------------------------------------------


def fa2_varlen_attention(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window=(-1, -1), scale=None):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q_THK, k_THK, v_THK, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, dropout_p=0.0, softmax_scale=scale,
        causal=False, window_size=(int(window[0]), int(window[1])),
    )


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


ORDER = ("torch", "aten", "fa2")  # support first: see the module docstring


def _available() -> dict[str, Callable]:
    impls: dict[str, Callable] = {}
    if _VARLEN_ATTN is not None:
        impls["torch"] = torch_varlen_attention
    if _aten_has_window():
        impls["aten"] = aten_varlen_attention
    # flash-attn 4 installs `flash_attn` as a namespace package without the FA2 interface
    if torch.cuda.is_available() and _installed("flash_attn") and _installed("flash_attn.flash_attn_interface"):
        impls["fa2"] = fa2_varlen_attention
    return {name: impls[name] for name in ORDER if name in impls}


IMPLS: dict[str, Callable] = _available()
CHOSEN: str | None = next(iter(IMPLS), None)
if CHOSEN is None:
    raise ImportError("no varlen flash attention with a window: needs torch >= 2.9 or flash-attn 2")
_CHOSEN_FN = IMPLS[CHOSEN]


def varlen_attention(
    q_THK: Tensor,
    k_THK: Tensor,
    v_THK: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
) -> Tensor:
    """Non-causal varlen attention with an FA window, on flash kernel `CHOSEN` (first of `ORDER`).

    Arguments:
        q_THK, k_THK, v_THK: (T, H, K) packed CUDA fp16 / bf16, K a multiple of 8 <= 256 (what
            `covers_varlen` accepts); last dim contiguous (other strides are free).
        cu_seqlens: (S+1,) int32 on the same device. max_seqlen: host int >= longest sequence.
        window: (left, right), -1 unbounded. scale: default K ** -0.5.
    Return:
        (T, H, K) in q's dtype.
    """
    if not covers_varlen(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen):
        raise InputError(f"flash varlen_attention: needs CUDA fp16 / bf16 q, k, v with a head dim that is a "
                         f"multiple of 8 up to 256, got {q_THK.dtype} {tuple(q_THK.shape)} on {q_THK.device}")
    return _CHOSEN_FN(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window, scale)


register_impl("flash", "varlen_attention", varlen_attention, covers=covers_varlen)


# ---- graph_attention: torch's efficient and flash kernels ------------------------------------------

GRAPH_CORES = ("efficient", "flash")
_MAX_FLASH_HEAD_DIM = 256  # FA2's limit; larger heads go to the efficient kernel


def aten_graph_attention(
    q_QHK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, scale: float, *, flash: bool = False,
) -> Tensor:
    """Bias-free packed attention with own query / key boundaries (autograd: torch's formulas).

    `flash=True` takes FA2 for fp16 / bf16 heads <= 256; otherwise the efficient kernel. The head
    dim must already be a multiple of 8.
    """
    lowp = q_QHK.dtype in (torch.float16, torch.bfloat16)
    if flash and lowp and q_QHK.shape[-1] <= _MAX_FLASH_HEAD_DIM:
        out = torch.ops.aten._flash_attention_forward(
            q_QHK, k_THK, v_THK, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            0.0, False, False, scale=scale,
        )
        return out[0]
    # The backward needs the log-sum-exp, which the kernel only writes when asked.
    need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q_QHK, k_THK, v_THK))
    out = torch.ops.aten._efficient_attention_forward(
        q_QHK[None], k_THK[None], v_THK[None], None, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, 0.0, 0, need_lse, scale=scale,
    )
    return out[0][0]


def _dqkv_from_shared(dq: Tensor, dk: Tensor, dv: Tensor) -> Tensor:
    """The (T, 3, H, K) tensor that `shared_storage_dqdkdv` allocated, without a copy when dq, dk,
    dv are its three slices (they are, in torch 2.11-2.13); otherwise a stack (one copy)."""
    _, T, H, K = dq.shape
    want = (3 * H * K * T, 3 * H * K, K, 1)
    shared = (
        dq.untyped_storage().data_ptr() == dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr()
        and dq.stride() == dk.stride() == dv.stride() == want
        and dk.storage_offset() - dq.storage_offset() == H * K
        and dv.storage_offset() - dq.storage_offset() == 2 * H * K
    )
    if shared:
        return dq.as_strided((T, 3, H, K), (3 * H * K, H * K, K, 1), dq.storage_offset())
    return torch.stack([dq[0], dk[0], dv[0]], dim=1)


class _EfficientQKV(torch.autograd.Function):
    """Efficient-kernel attention on a fused qkv buffer whose gradient is one (T, 3, H, K) tensor."""

    @staticmethod
    def forward(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float):
        q, k, v = qkv[None].unbind(2)  # (1, T, H, K) views, row stride 3HK
        out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
            q, k, v, None, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, 0, True, scale=scale,
        )
        return out[0], lse, seed, offset

    @staticmethod
    def setup_context(ctx, inputs, output):
        qkv, cu_seqlens, max_seqlen, scale = inputs
        out, lse, seed, offset = output
        ctx.save_for_backward(qkv, out, lse, cu_seqlens, seed, offset)
        ctx.mark_non_differentiable(lse, seed, offset)
        ctx.args = (max_seqlen, scale)

    @staticmethod
    def backward(ctx, dout, *_):
        qkv, out, lse, cu_seqlens, seed, offset = ctx.saved_tensors
        max_seqlen, scale = ctx.args
        q, k, v = qkv[None].unbind(2)
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            dout[None], q, k, v, None, out[None], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, lse,
            0.0, seed, offset, 0, False, scale=scale, shared_storage_dqdkdv=True,
        )
        return _dqkv_from_shared(dq, dk, dv), None, None, None


def efficient_qkv_attention(qkv_T3HK: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float) -> Tensor:
    """The efficient kernel on a fused (T, 3, H, K) buffer (head dim a multiple of 8): (T, H, K)."""
    if torch.is_grad_enabled() and qkv_T3HK.requires_grad:
        return _EfficientQKV.apply(qkv_T3HK, cu_seqlens, max_seqlen, scale)[0]
    q, k, v = qkv_T3HK[None].unbind(2)
    out = torch.ops.aten._efficient_attention_forward(
        q, k, v, None, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, 0, False, scale=scale,
    )
    return out[0][0]


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
    *,
    core: str | Callable[..., Tensor] = "efficient",
) -> Tensor:
    """`reference.graph_attention` on torch's kernels (same signature and result).

    With k_THK = v_THK = None, q_QHK is the fused (T, 3, H, K) qkv buffer of a full layer
    (cu_seqlens_q = cu_seqlens_k); on the efficient core its gradient then stays one tensor.
    `core`: "efficient" (any dtype), "flash" (fp16 / bf16; fp32 runs "efficient"), or a callable
    taking (q, k, v, cu_q, cu_k, max_q, max_k, scale) with head dims padded to a multiple of 8:
    tests pass the reference there to check the folding and padding on the CPU.
    """
    if not callable(core) and core not in GRAPH_CORES:
        raise InputError(f"graph_attention: unknown core {core!r}; choose one of {GRAPH_CORES}")
    fused = k_THK is None
    if fused != (v_THK is None):
        raise InputError("graph_attention: give k and v, or neither (fused qkv)")
    K = q_QHK.shape[-1]
    scale = K**-0.5 if scale is None else scale
    cu_seqlens_q, cu_seqlens_k = (c if c.dtype == torch.int32 else c.to(torch.int32)
                                  for c in (cu_seqlens_q, cu_seqlens_k))
    use_flash = core == "flash" and q_QHK.dtype in (torch.float16, torch.bfloat16)
    if fused and not callable(core) and not use_flash:
        qkv = q_QHK if key_bias_TH is None else fold_key_bias_qkv(q_QHK, key_bias_TH, scale)
        return efficient_qkv_attention(pad_head_dim(qkv), cu_seqlens_k, max_seqlen_k, scale)[..., :K]
    if fused:
        q_QHK, k_THK, v_THK = q_QHK.unbind(1)
    if key_bias_TH is not None:
        q_QHK, k_THK, v_THK = fold_key_bias(q_QHK, k_THK, v_THK, key_bias_TH, scale)
    q, k, v = (pad_head_dim(t) for t in (q_QHK, k_THK, v_THK))
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
    out = core(*args) if callable(core) else aten_graph_attention(*args, flash=use_flash)
    return out[..., :K]


register_impl("flash", "graph_attention", graph_attention)
