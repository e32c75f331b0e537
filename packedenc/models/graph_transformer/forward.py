"""Forward of GiGL's `GraphTransformerEncoder` as a pure function over packed token sequences.

Matches `gigl/nn/graph_transformer.py` (Snapchat/GiGL v0.3.1) in eval mode (no dropout): GiGL
pads each anchor's tokens to (B, L, D) and masks padded keys with an additive bias; here the
same tokens lie back to back (`x [T, F]`, `cu_seqlens`) and attention never crosses a sequence
boundary, so real tokens see exactly what they see in GiGL (padding gets zero softmax weight).

Per forward: per-node-type input projection (or already projected tokens) -> + hop-distance
embedding -> pre-norm layers (LayerNorm, Q/K/V/O with biases, SDPA scale, + per-key head bias
from anchor-relative token features; LayerNorm, FFN) -> final LayerNorm -> readout -> output
projection -> optional L2 normalisation. With `readout_mode="anchor_only"` the last layer
computes only the anchors' queries (GiGL PR #732): keys and values still cover every token.

Shapes: T packed tokens, S sequences (= anchors), D hid_dim, H heads, K head dim, F input
features, A key-bias features, O out_dim.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as Fn
from torch import Tensor

from packedenc.errors import InputError
from packedenc.kernels import Ops, get_ops
from packedenc.models.graph_transformer.config import XGLU, GraphTransformerConfig
from packedenc.models.graph_transformer.params import (
    HOP_EMBEDDING,
    EncoderLayer,
    GraphTransformerParams,
)
from packedenc.packing import check_cu_seqlens, positions_from_cu_seqlens, segment_ids

__all__ = ["encode", "project_nodes", "layer", "readout"]


# ---- layers ---------------------------------------------------------------------------------


def _qkv_weights(p: EncoderLayer) -> tuple[Tensor, Tensor | None]:
    # One (3D, D) GEMM instead of three; concatenating D x D weights costs nothing next to it.
    w = torch.cat([p.query_projection.weight, p.key_projection.weight, p.value_projection.weight])
    bs = [p.query_projection.bias, p.key_projection.bias, p.value_projection.bias]
    return w, None if any(b is None for b in bs) else torch.cat(bs)


def _ffn(p: EncoderLayer, h_XD: Tensor, cfg: GraphTransformerConfig, ops: Ops) -> Tensor:
    u = ops.linear(h_XD, p.ffn.linear_in.weight, p.ffn.linear_in.bias)
    g = ops.glu(u, XGLU[cfg.activation]) if cfg.is_xglu else ops.activation(u, cfg.activation)
    return ops.linear(g, p.ffn.linear_out.weight, p.ffn.linear_out.bias)


def layer(
    p: EncoderLayer,
    x_TD: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    key_bias_TH: Tensor | None,
    cfg: GraphTransformerConfig,
    ops: Ops,
    *,
    anchors_only: bool = False,
) -> Tensor:
    """One pre-norm encoder layer. Pure: returns a new tensor.

    Arguments:
        x_TD: (T, D) packed token states. cu_seqlens: (S+1,) int32. max_seqlen: host int.
        key_bias_TH: (T, H) additive per-key score bias, or None.
        anchors_only: compute only the first token of every sequence (queries, residual and FFN);
            keys and values still cover all tokens. Returns (S, D) instead of (T, D).
    """
    T, H, K = x_TD.shape[0], cfg.num_heads, cfg.head_dim
    an = p.attention_norm
    h_TD = ops.layer_norm(x_TD, an.weight, an.bias, cfg.norm_eps)
    w, b = _qkv_weights(p)
    if anchors_only:
        S = cu_seqlens.numel() - 1
        idx_S = cu_seqlens[:-1].long()
        resid_XD = x_TD.index_select(0, idx_S)
        q_XHK = ops.linear(h_TD.index_select(0, idx_S), w[:H * K], None if b is None else b[:H * K]).view(S, H, K)
        kv_T2HK = ops.linear(h_TD, w[H * K:], None if b is None else b[H * K:]).view(T, 2, H, K)
        k_THK, v_THK = kv_T2HK[:, 0], kv_T2HK[:, 1]
        cu_q = torch.arange(S + 1, dtype=torch.int32, device=x_TD.device)
        o_XHK = ops.graph_attention(q_XHK, k_THK, v_THK, cu_q, cu_seqlens, 1, max_seqlen, key_bias_TH)
    else:
        resid_XD = x_TD
        qkv_T3HK = ops.linear(h_TD, w, b).view(T, 3, H, K)
        q_XHK, k_THK, v_THK = qkv_T3HK.unbind(1)
        o_XHK = ops.graph_attention(q_XHK, k_THK, v_THK, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                    key_bias_TH)
    X = o_XHK.shape[0]
    op = p.output_projection
    x_XD = resid_XD + ops.linear(o_XHK.reshape(X, H * K), op.weight, op.bias)
    fn = p.ffn_norm
    return x_XD + _ffn(p, ops.layer_norm(x_XD, fn.weight, fn.bias, cfg.norm_eps), cfg, ops)


# ---- readout --------------------------------------------------------------------------------


def readout(params: GraphTransformerParams, z_TD: Tensor, cu_seqlens: Tensor) -> Tensor:
    """GiGL's "anchor_neighbor_attention" readout on packed final states: (T, D) -> (S, D).

    out_s = z_anchor + sum_{t >= 1} w_t z_t with w = softmax_t(r . [z_anchor, z_t] + b) over the
    sequence's neighbours; a sequence without neighbours returns its anchor. fp32 math.
    """
    T, D = z_TD.shape
    S = cu_seqlens.numel() - 1
    seg_T = segment_ids(cu_seqlens, T)
    is_anchor_T = positions_from_cu_seqlens(cu_seqlens, T) == 0
    z = z_TD.float()
    r = params.readout_attention
    w_2D = r.weight.float().reshape(2, D)
    anchor_SD = z.index_select(0, cu_seqlens[:-1].long())
    s_T = z @ w_2D[1] + (anchor_SD @ w_2D[0]).index_select(0, seg_T)
    if r.bias is not None:
        s_T = s_T + r.bias.float()
    s_T = s_T.masked_fill(is_anchor_T, float("-inf"))
    m_S = torch.full((S,), float("-inf"), device=z.device).scatter_reduce(
        0, seg_T, s_T.detach(), reduce="amax", include_self=True
    )
    m_S = torch.where(torch.isfinite(m_S), m_S, torch.zeros_like(m_S))  # anchor-only sequences
    e_T = torch.exp(s_T - m_S.index_select(0, seg_T))  # 0 at anchors
    den_S = torch.zeros(S, device=z.device).index_add(0, seg_T, e_T)
    w_T = e_T / den_S.clamp_min(torch.finfo(torch.float32).tiny).index_select(0, seg_T)
    agg_SD = torch.zeros(S, D, device=z.device).index_add(0, seg_T, w_T[:, None] * z)
    return (anchor_SD + agg_SD).to(z_TD.dtype)


# ---- inputs ---------------------------------------------------------------------------------


def project_nodes(params: GraphTransformerParams, x_by_type: Mapping[str, Tensor], *,
                  backend: str | Ops = "auto") -> Tensor:
    """Per-node input projection (GiGL projects nodes before building sequences): -> (N, D).

    Arguments:
        x_by_type: {node type: (N_t, F_t) features}; every config node type present.
    Return:
        (sum N_t, D), node types stacked in config order; gather token rows from it and call
        `encode(..., projected=True)`.
    """
    cfg = params.config
    missing = [t for t in cfg.node_types if t not in x_by_type]
    if missing:
        raise InputError(f"project_nodes: no features for node types {missing}")
    ops = get_ops(backend, next(iter(x_by_type.values())).device)
    dtype = params.output_projection.weight.dtype
    outs = []
    for t, f in cfg.node_type_to_feat_dim_map:
        x = x_by_type[t]
        if x.dim() != 2 or x.shape[1] != f:
            raise InputError(f"features of node type {t!r} must be (N, {f}), got {tuple(x.shape)}")
        lin = params.node_projection_dict[t]
        outs.append(ops.linear(x.to(dtype), lin.weight, lin.bias))
    return torch.cat(outs)


def _project_tokens(params: GraphTransformerParams, x_TF: Tensor, node_types_T: Tensor | None,
                    ops: Ops) -> Tensor:
    cfg = params.config
    if len(cfg.node_types) == 1:
        lin = params.node_projection_dict[cfg.node_types[0]]
        return ops.linear(x_TF, lin.weight, lin.bias)
    # Each type's Linear on every token, then a select: no data-dependent shapes, no host sync,
    # and the extra GEMMs are small next to the layers (node types are few).
    out_TD = None
    for i, (t, f) in enumerate(cfg.node_type_to_feat_dim_map):
        lin = params.node_projection_dict[t]
        y_TD = ops.linear(x_TF[:, :f], lin.weight, lin.bias)
        out_TD = y_TD if out_TD is None else torch.where((node_types_T == i)[:, None], y_TD, out_TD)
    return out_TD


def _check_inputs(params: GraphTransformerParams, x: Tensor, cu_seqlens: Tensor, max_seqlen: int | None,
                  hops: Tensor | None, node_types: Tensor | None, key_features: Tensor | None,
                  projected: bool, validate: bool) -> tuple[Tensor, int]:
    """Shape / dtype checks always; value checks on the CPU or with validate=True (they sync)."""
    cfg = params.config
    if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise InputError(f"x must be a floating (T, F) tensor of token features, got "
                         f"{type(x).__name__ if not isinstance(x, Tensor) else (tuple(x.shape), x.dtype)}")
    check_cu_seqlens(cu_seqlens, values=False)
    if cu_seqlens.device != x.device:
        raise InputError(f"cu_seqlens is on {cu_seqlens.device} but x on {x.device}; move both")
    T = x.shape[0]
    want = cfg.hid_dim if projected else max(cfg.feat_dims)
    if x.shape[1] != want:
        what = "hid_dim (projected=True)" if projected else "the largest node feature dim"
        raise InputError(f"x has {x.shape[1]} features per token but {what} is {want}")

    def check_tok(name: str, t: Tensor | None, needed: bool, why: str, integer: bool, width: int | None) -> None:
        if t is None:
            if needed:
                raise InputError(f"{name}= is required: {why}")
            return
        if not needed:
            raise InputError(f"{name}= was given but these params do not use it ({why})")
        shape_ok = t.dim() == 1 if width is None else (t.dim() == 2 and t.shape[1] == width)
        if not shape_ok or t.shape[0] != T:
            raise InputError(f"{name} must have shape ({T}{'' if width is None else f', {width}'}), got {tuple(t.shape)}")
        if integer == t.is_floating_point() or t.dtype == torch.bool:
            raise InputError(f"{name} must be {'an integer' if integer else 'a floating'} tensor, got {t.dtype}")
        if t.device != x.device:
            raise InputError(f"{name} is on {t.device} but x on {x.device}")

    multi = len(cfg.node_types) > 1 and not projected
    check_tok("node_types", node_types, multi,
              f"the config has node types {cfg.node_types}; pass each token's index into that list"
              if multi else "one node type, or x already projected", True, None)
    check_tok("hops", hops, cfg.hop_distance_embedding_size > 0,
              "the hop-distance embedding adds Emb[hops] to each token (anchor = 0)", True, None)
    check_tok("key_features", key_features, cfg.key_bias_dim > 0,
              f"anchor-relative attention bias over {list(cfg.anchor_based_attention_bias_attr_names)}",
              False, cfg.key_bias_dim)

    if validate or x.device.type == "cpu":
        check_cu_seqlens(cu_seqlens, T)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        if max_seqlen is not None and max_seqlen < longest:
            raise InputError(f"max_seqlen={max_seqlen} is smaller than the longest sequence ({longest})")
        for name, t, hi in (("node_types", node_types, len(cfg.node_types)),
                            ("hops", hops, cfg.hop_distance_embedding_size)):
            if t is not None and (int(t.min()) < 0 or int(t.max()) >= hi):
                raise InputError(f"{name} values must lie in [0, {hi}), got [{int(t.min())}, {int(t.max())}]")
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if cu_seqlens.dtype != torch.int32:
        cu_seqlens = cu_seqlens.to(torch.int32)
    return cu_seqlens, int(max_seqlen)


def encode(
    params: GraphTransformerParams,
    x: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int | None = None,
    *,
    hops: Tensor | None = None,
    node_types: Tensor | None = None,
    key_features: Tensor | None = None,
    projected: bool = False,
    return_tokens: bool = False,
    backend: str | Ops = "auto",
    validate: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """One embedding per anchor (sequence) from packed node tokens. Pure; no dropout.

    Arguments:
        params: `GraphTransformerParams` (from `init`, or `packedenc.convert.gigl.from_gigl`).
        x: (T, F) token features, sequences back to back, each starting with its anchor. With
            several node types F is the largest feature dim and a token of type t uses its first
            F_t columns. With `projected=True`, x is (T, hid_dim) already projected (`project_nodes`).
        cu_seqlens: (S+1,) int32 boundaries (from `packedenc.packing.khop_sequences` or `pack`).
        max_seqlen: host int, the longest sequence; computed (one host sync) when None.
        hops: (T,) int hop distance of each token from its anchor (anchor = 0); required iff the
            params have the hop-distance embedding.
        node_types: (T,) int index into `config.node_type_to_feat_dim_map`; required iff the
            config has several node types (and x is not projected).
        key_features: (T, A) anchor-relative features of each token, columns in the order of
            `config.anchor_based_attention_bias_attr_names`; required iff that list is non-empty.
        return_tokens: also return every token's final state (after the final norm); the last
            layer then runs on all tokens even with the anchor-only readout.
        backend: "auto", "reference", "flash", ..., or an `Ops` table. validate: check values of
            the inputs even when they live on a GPU (syncs).
    Return:
        (S, out_dim) in the params' dtype; with return_tokens, ((S, out_dim), (T, hid_dim)).
    """
    cfg = params.config
    cu_seqlens, max_seqlen = _check_inputs(params, x, cu_seqlens, max_seqlen, hops, node_types,
                                           key_features, projected, validate)
    ops = get_ops(backend, x.device)
    dtype = params.output_projection.weight.dtype
    x = x.to(dtype)
    h_TD = x if projected else _project_tokens(params, x, node_types, ops)
    if hops is not None:
        h_TD = h_TD + params.anchor_based_input_embedding_dict[HOP_EMBEDDING].weight.index_select(0, hops.long())
    kb_TH = None
    if key_features is not None:  # GiGL casts the features to the activation dtype, then projects
        kb_TH = ops.linear(key_features.to(dtype), params.anchor_pe_attention_bias_projection.weight)

    layers = params.encoder_layers
    last_anchor_only = cfg.readout_mode == "anchor_only" and not return_tokens and len(layers) > 0
    for p in layers[: len(layers) - int(last_anchor_only)]:
        h_TD = layer(p, h_TD, cu_seqlens, max_seqlen, kb_TH, cfg, ops)
    fnorm = params.final_norm
    if last_anchor_only:
        h_SD = layer(layers[-1], h_TD, cu_seqlens, max_seqlen, kb_TH, cfg, ops, anchors_only=True)
        out_SD = ops.layer_norm(h_SD, fnorm.weight, fnorm.bias, cfg.norm_eps)
        z_TD = None
    else:
        z_TD = ops.layer_norm(h_TD, fnorm.weight, fnorm.bias, cfg.norm_eps)
        if cfg.readout_mode == "anchor_only":
            out_SD = z_TD.index_select(0, cu_seqlens[:-1].long())
        else:
            out_SD = readout(params, z_TD, cu_seqlens)
    o = params.output_projection
    out_SO = ops.linear(out_SD, o.weight, o.bias)
    if cfg.should_l2_normalize_embedding_layer_output:
        out_SO = Fn.normalize(out_SO.float(), p=2.0, dim=-1).to(out_SO.dtype)
    return (out_SO, z_TD) if return_tokens else out_SO
