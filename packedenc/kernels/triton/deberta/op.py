"""The DeBERTa disentangled attention as a registered op: `packedenc::deberta_attention` (CPU: the
reference; CUDA: `forward.py`), its backward op (CPU: the explicit-formula reference; CUDA:
`backward.py`), the autograd registration, and `deberta_attention`, the Ops-table entry.

Shapes: T packed tokens, S sequences, H heads, K head dim, R position-table rows.

The registered ops launch with the shipped options (`launch.TILES`): a custom op's schema carries
tensors and scalars only. A caller that times or tests other tiles calls the launchers directly.

Unlike the other Triton ops these are opaque `custom_op`s, not `triton_op`s: the launchers keep the
relative-position slot tables cached per device (real tensors, built with host reads of their
values, `slots.py`), which a trace cannot take in, so torch.compile calls the op as a whole.
"""

from __future__ import annotations

import torch
from torch import Tensor

from packedenc.kernels.reference import deberta as reference
from packedenc.kernels.triton._common import direct_launch, eager_autograd, eager_cuda, launch_or_op
from packedenc.kernels.triton.deberta.backward import deberta_attention_bwd
from packedenc.kernels.triton.deberta.forward import deberta_attention_fwd
from packedenc.packing import check_seq_order

__all__ = ["deberta_attention"]


# ---- registered ops (CPU: the reference; CUDA: the kernels) ------------------------------------


@torch.library.custom_op("packedenc::deberta_attention", mutates_args=(), device_types="cpu")
def _deberta_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, pos_key: Tensor | None,
    pos_query: Tensor | None, position_buckets: int, max_relative_positions: int, scale: float,
    seq_order: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    types = tuple(t for t, x in (("c2p", pos_key), ("p2c", pos_query)) if x is not None)
    o = reference.deberta_attention(q, k, v, cu_seqlens, max_seqlen, pos_key, pos_query, pos_att_type=types,
                                    position_buckets=position_buckets, max_relative_positions=max_relative_positions,
                                    scale=scale)
    lse = reference.deberta_attention_lse(q, k, cu_seqlens, max_seqlen, pos_key, pos_query, position_buckets,
                                          max_relative_positions, scale)
    return o.contiguous(), lse


@_deberta_attention.register_kernel("cuda")
def _deberta_attention_cuda(q, k, v, cu_seqlens, max_seqlen, pos_key, pos_query, position_buckets, max_relative_positions, scale,
      seq_order=None):
    return deberta_attention_fwd(q, k, v, cu_seqlens, max_seqlen, pos_key, pos_query, position_buckets,
                                 max_relative_positions, scale, seq_order=seq_order)


@_deberta_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, pos_key, pos_query, position_buckets, max_relative_positions, scale,
      seq_order=None):
    T, H, K = q.shape
    return q.new_empty((T, H, K)), q.new_empty((T, H), dtype=torch.float32)


# The backward op returns empty (0,) tensors for absent tables: custom ops cannot return None.
@torch.library.custom_op("packedenc::deberta_attention_bwd", mutates_args=(), device_types="cpu")
def _deberta_attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_seqlens: Tensor, max_seqlen: int,
    pos_key: Tensor | None, pos_query: Tensor | None, position_buckets: int, max_relative_positions: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = reference.deberta_attention_bwd(do, q, k, v, cu_seqlens, max_seqlen, pos_key, pos_query,
                                            position_buckets, max_relative_positions, scale)
    return tuple(g if g is not None else q.new_empty((0,)) for g in grads)


@_deberta_attention_bwd.register_kernel("cuda")
def _deberta_attention_bwd_cuda(do, q, k, v, o, lse, cu_seqlens, max_seqlen, pos_key, pos_query, position_buckets, max_relative_positions,
      scale):
    grads = deberta_attention_bwd(do, q, k, v, o, lse, cu_seqlens, max_seqlen, pos_key, pos_query,
                                  position_buckets, max_relative_positions, scale)
    return tuple(g if g is not None else q.new_empty((0,)) for g in grads)


@_deberta_attention_bwd.register_fake
def _(do, q, k, v, o, lse, cu_seqlens, max_seqlen, pos_key, pos_query, position_buckets, max_relative_positions,
      scale):
    T, H, K = q.shape
    tables = (t.new_empty(t.shape) if t is not None else q.new_empty((0,)) for t in (pos_key, pos_query))
    return (q.new_empty((T, H, K)), q.new_empty((T, H, K)), q.new_empty((T, H, K)), *tables)


def _setup(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, pos_key, pos_query, buckets, max_rel, scale, _ = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zero-filled (T, H) gradient for the LSE in every layer's backward
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens, pos_key, pos_query)
    ctx.args = (max_seqlen, buckets, max_rel, scale)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, cu_seqlens, pos_key, pos_query = ctx.saved_tensors
    max_seqlen, buckets, max_rel, scale = ctx.args
    dq, dk, dv, dpk, dpq = launch_or_op(_deberta_attention_bwd_cuda, torch.ops.packedenc.deberta_attention_bwd,
                                        do, q, k, v, o, lse, cu_seqlens, max_seqlen, pos_key, pos_query, buckets,
                                        max_rel, scale)
    return (dq, dk, dv, None, None, dpk if pos_key is not None else None, dpq if pos_query is not None else None,
            None, None, None, None)


_deberta_attention.register_autograd(_backward, setup_context=_setup)
_deberta_attention_eager = eager_autograd(_deberta_attention_cuda, _setup, _backward)


# ---- the Ops-table entry: the reference signature ----------------------------------------------


def deberta_attention(
    q_THK: Tensor,
    k_THK: Tensor,
    v_THK: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    pos_key_RHK: Tensor | None = None,
    pos_query_RHK: Tensor | None = None,
    *,
    pos_att_type: tuple[str, ...] = (),
    position_buckets: int = -1,
    max_relative_positions: int = -1,
    scale: float,
    seq_order: Tensor | None = None,
) -> Tensor:
    """DeBERTa disentangled attention inside each packed sequence; see `reference.deberta_attention`.

    Arguments:
        q_THK, k_THK, v_THK: (T, H, K) with the head dim contiguous (views of the fused qkv are fine).
        cu_seqlens: (S+1,) int32. max_seqlen: host int >= the longest sequence.
        pos_key_RHK / pos_query_RHK: (R, H, K) c2p / p2c tables, present iff the term is in pos_att_type.
        position_buckets, max_relative_positions, scale: as in the reference.
        seq_order: (S,) int32 permutation from `packing.longest_first(cu_seqlens)`, or None: the
            programs take the sequences in this order (the result does not depend on it). Longest
            first shortens a ragged batch's last wave (H200, doc1k: benchmarks/results/history/NOTES-diary.md).
    Return:
        (T, H, K) contiguous in q's dtype; fp32 scores and softmax, one rounding. Differentiable in
        q, k, v and both tables (Triton backward on CUDA; dq, dPK and dPQ are fp32 atomics, see
        `backward.py`).
    """
    c2p, p2c = "c2p" in pos_att_type, "p2c" in pos_att_type
    assert (pos_key_RHK is not None) == c2p and (pos_query_RHK is not None) == p2c, pos_att_type
    check_seq_order(seq_order, cu_seqlens)
    args = (q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, pos_key_RHK, pos_query_RHK, position_buckets,
            max_relative_positions, scale)
    if direct_launch(q_THK, k_THK, v_THK, pos_key_RHK, pos_query_RHK):
        return deberta_attention_fwd(*args, store_lse=False, seq_order=seq_order)[0]
    if eager_cuda(q_THK, k_THK, v_THK, pos_key_RHK, pos_query_RHK):  # eager training: no dispatcher
        return _deberta_attention_eager(*args, seq_order)[0]
    return torch.ops.packedenc.deberta_attention(*args, seq_order)[0]
