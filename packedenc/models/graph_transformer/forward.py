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

from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from packedenc.errors import InputError
from packedenc.kernels import Ops, get_ops
from packedenc.models.graph_transformer.config import XGLU, GraphTransformerConfig
from packedenc.models.graph_transformer.params import (
    HOP_EMBEDDING,
    EncoderLayer,
    GraphTransformerParams,
)
from packedenc.checks import check_cu_seqlens, check_max_seqlen, host_values

__all__ = ["encode", "project_nodes", "layer", "readout"]


# ---- layers ---------------------------------------------------------------------------------
#
# The residual stream is carried as (delta, residual): a block returns its output un-added and the
# next norm adds it with `ops.add_layer_norm`, which rounds the sum to the activation dtype before
# the statistics (exactly GiGL's `x = x + f(x)` then `norm(x)`) and returns that sum as the new
# residual: one fused kernel (and one fused backward) instead of an add and a norm.
#
# Biases ride with the elementwise op after their GEMM instead of inside it: the block's last GEMM
# (attention output projection, FFN output) runs without its bias, which goes to the next norm as
# `add_layer_norm(..., x_bias=b)` (a block returns (delta, delta_bias)); the FFN's first GEMM runs
# without its bias, which `ops.activation(..., bias=b)` adds. The kernels' backward passes then
# return those biases' gradients as column sums of gradients they already read, where autograd
# would run a separate (T, width) reduction per biased GEMM (~5 ms of a 70 ms bf16 training
# pass, benchmarks/results/history/NOTES-diary.md). The sum is rounded once (x + b + residual in fp32) rather than after the GEMM and again
# after the add: fp32 results move by fp32 rounding, bf16 ones get slightly closer to fp32.

def _qkv_weights(p: EncoderLayer) -> tuple[Tensor, Tensor | None]:
    # One (3D, D) GEMM instead of three; concatenating D x D weights costs nothing next to it.
    w = torch.cat([p.query_projection.weight, p.key_projection.weight, p.value_projection.weight])
    bs = [p.query_projection.bias, p.key_projection.bias, p.value_projection.bias]
    return w, None if any(b is None for b in bs) else torch.cat(bs)


class _ActLinear(torch.autograd.Function):
    """linear(act(u, b), W) (no bias) that saves u (not act(u, b)) and recomputes act in the backward.

    `act(u, b)` is the FFN activation with its fused input bias `b` (None for gated FFNs, whose
    first GEMM keeps its bias); the recompute's backward gives du and db together."""

    @staticmethod
    def forward(u: Tensor, bias_in: Tensor | None, weight: Tensor, act: Callable[..., Tensor],
                linear: Callable[..., Tensor]) -> Tensor:
        return linear(act(u, bias_in), weight, None)

    @staticmethod
    def setup_context(ctx, inputs, output):
        u, bias_in, weight, act, _ = inputs
        ctx.save_for_backward(u, bias_in, weight)
        ctx.act = act

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        u, bias_in, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dg = dy @ weight  # first: the recomputed act(u) then lives only for the weight gradient
        need_u, need_b = ctx.needs_input_grad[0], bias_in is not None and ctx.needs_input_grad[1]
        with torch.enable_grad():
            u_ = u.detach().requires_grad_(need_u)
            b_ = None if bias_in is None else bias_in.detach().requires_grad_(need_b)
            g = ctx.act(u_, b_)
        dw = dy2.t() @ g.detach().reshape(-1, g.shape[-1])
        leaves = [t for t, need in ((u_, need_u), (b_, need_b)) if need]
        got = iter(torch.autograd.grad(g, leaves, dg) if leaves else ())
        return next(got) if need_u else None, next(got) if need_b else None, dw, None, None


def _ffn(p: EncoderLayer, h_XD: Tensor, cfg: GraphTransformerConfig, ops: Ops,
         recompute: bool = False) -> tuple[Tensor, Tensor | None]:
    """(FFN output without linear_out's bias, that bias): the caller's next norm adds it. recompute:
    under eager autograd save only u and recompute act(u) in the backward (`encode`'s recompute_ffn)."""
    lin_in, out = p.ffn.linear_in, p.ffn.linear_out
    if cfg.is_xglu:  # ops.glu takes no bias: linear_in keeps its bias in the GEMM
        u, bias_in = ops.linear(h_XD, lin_in.weight, lin_in.bias), None

        def act(u: Tensor, b: Tensor | None, overwrite_input: bool = False) -> Tensor:
            return ops.glu(u, act=XGLU[cfg.activation], overwrite_input=overwrite_input)
    else:
        u, bias_in = ops.linear(h_XD, lin_in.weight, None), lin_in.bias

        def act(u: Tensor, b: Tensor | None, overwrite_input: bool = False) -> Tensor:
            return ops.activation(u, cfg.activation, overwrite_input=overwrite_input, bias=b)
    if recompute and torch.is_grad_enabled() and _plain_autograd() and (
            u.requires_grad or (bias_in is not None and bias_in.requires_grad)):
        return _ActLinear.apply(u, bias_in, out.weight, act, ops.linear), out.bias
    # u is this call's own temporary: inference kernels may write act(u + b) over it
    return ops.linear(act(u, bias_in, overwrite_input=True), out.weight, None), out.bias


def _plain_autograd() -> bool:
    """Eager autograd: no torch.compile trace, no torch.func transform (they keep act(u))."""
    if torch.compiler.is_compiling():
        return False
    try:
        return torch._C._functorch.peek_interpreter_stack() is None
    except AttributeError:  # private hook moved: keep both tensors, always correct
        return False


def _add_norm(ops: Ops, delta: Tensor, residual: Tensor, norm, eps: float,
              delta_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """(norm(delta + delta_bias + residual), that sum); the bias rides into the fused kernel."""
    if delta_bias is None:  # the op as every other family calls it
        return ops.add_layer_norm(delta, residual, norm.weight, norm.bias, eps)
    return ops.add_layer_norm(delta, residual, norm.weight, norm.bias, eps, x_bias=delta_bias)


def layer(
    p: EncoderLayer,
    delta_TD: Tensor | None,
    residual_TD: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    key_bias_TH: Tensor | None,
    cfg: GraphTransformerConfig,
    ops: Ops,
    *,
    anchors_only: bool = False,
    delta_bias: Tensor | None = None,
    recompute_ffn: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One pre-norm encoder layer on the stream `residual + delta + delta_bias`. Pure: returns new tensors.

    Arguments:
        delta_TD: (T, D) previous block's output not yet added to residual_TD, or None.
        residual_TD: (T, D) packed token states. cu_seqlens: (S+1,) int32. max_seqlen: host int.
        key_bias_TH: (T, H) additive per-key score bias, or None.
        anchors_only: compute only the first token of every sequence (queries, residual and FFN);
            keys and values still cover all tokens. Returns (S, D) tensors instead of (T, D).
        delta_bias: (D,) the previous block's output bias, not yet added to delta_TD, or None.
        recompute_ffn: recompute the FFN activation in the backward instead of saving it (`encode`).
    Return:
        (delta, residual, delta_bias): this layer's output is residual + delta + delta_bias, all
        three added (one rounding) by the next `add_layer_norm(..., x_bias=delta_bias)`; a caller
        without a following norm adds them itself. delta_bias is the FFN's output bias (or None).
    """
    T, H, K = residual_TD.shape[0], cfg.num_heads, cfg.head_dim
    an, eps = p.attention_norm, cfg.norm_eps
    if delta_TD is None:
        assert delta_bias is None, "layer: delta_bias without delta_TD"
        h_TD = ops.layer_norm(residual_TD, an.weight, an.bias, eps)
    else:
        h_TD, residual_TD = _add_norm(ops, delta_TD, residual_TD, an, eps, delta_bias)
    w, b = _qkv_weights(p)
    if anchors_only:
        S = cu_seqlens.numel() - 1
        idx_S = cu_seqlens[:-1].long()
        resid_XD = residual_TD.index_select(0, idx_S)
        q_XHK = ops.linear(h_TD.index_select(0, idx_S), w[:H * K], None if b is None else b[:H * K]).view(S, H, K)
        kv_T2HK = ops.linear(h_TD, w[H * K:], None if b is None else b[H * K:]).view(T, 2, H, K)
        cu_q = torch.arange(S + 1, dtype=torch.int32, device=residual_TD.device)
        k_THK, v_THK = kv_T2HK.unbind(1)  # one stacked gradient, not two zero-filled ones (see deberta/model.py)
        o_XHK = ops.graph_attention(q_XHK, k_THK, v_THK, cu_q, cu_seqlens, 1, max_seqlen, key_bias_TH)
    else:
        resid_XD = residual_TD
        # The fused (T, 3, H, K) buffer goes to the op whole, so kernels can hand back its gradient
        # as one tensor for the one GEMM's backward.
        qkv_T3HK = ops.linear(h_TD, w, b).view(T, 3, H, K)
        o_XHK = ops.graph_attention(qkv_T3HK, None, None, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                    key_bias_TH)
    X = o_XHK.shape[0]
    op, fn = p.output_projection, p.ffn_norm
    a_XD = ops.linear(o_XHK.reshape(X, H * K), op.weight, None)  # op.bias: added by the norm
    h_XD, resid_XD = _add_norm(ops, a_XD, resid_XD, fn, eps, op.bias)
    f_XD, f_bias = _ffn(p, h_XD, cfg, ops, recompute_ffn)
    return f_XD, resid_XD, f_bias


# ---- readout --------------------------------------------------------------------------------


def readout(params: GraphTransformerParams, z_TD: Tensor, cu_seqlens: Tensor, max_seqlen: int | None = None,
            *, backend: str | Ops = "auto") -> Tensor:
    """GiGL's "anchor_neighbor_attention" readout on packed final states: (T, D) -> (S, D).

    out_s = z_anchor + sum_{t >= 1} w_t z_t with w = softmax_t(r . [z_anchor, z_t] + b) over the
    sequence's neighbours; a sequence without neighbours returns its anchor (`ops.graph_readout`).
    """
    r = params.readout_attention
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return get_ops(backend, z_TD.device).graph_readout(z_TD, r.weight, r.bias, cu_seqlens, max_seqlen)


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

    values = host_values(x, validate)
    if values:
        check_cu_seqlens(cu_seqlens, T)
    check_max_seqlen(max_seqlen, cu_seqlens if values else None)
    if values:
        for name, t, hi in (("node_types", node_types, len(cfg.node_types)),
                            ("hops", hops, cfg.hop_distance_embedding_size)):
            if t is not None and (int(t.min()) < 0 or int(t.max()) >= hi):
                raise InputError(f"{name} values must lie in [0, {hi}), got [{int(t.min())}, {int(t.max())}]")
    if max_seqlen is None or values:  # host values: the true longest (free), never a looser bound
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
    recompute_ffn: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """One embedding per anchor (sequence) from packed node tokens. Pure; no dropout.

    Arguments:
        params: `GraphTransformerParams` (from `init`, or `packedenc.convert.gigl.from_gigl`).
        x: (T, F) token features, sequences back to back, each starting with its anchor. With
            several node types F is the largest feature dim and a token of type t uses its first
            F_t columns. With `projected=True`, x is (T, hid_dim) already projected (`project_nodes`).
        cu_seqlens: (S+1,) int32 boundaries (from `packedenc.models.graph_transformer.khop_sequences` or `pack`).
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
        recompute_ffn: for training with less memory: each layer saves only the FFN's
            pre-activation u for the backward and recomputes act(u) there (one elementwise pass),
            (T, ffn_dim) fewer saved elements per layer, 1/4 of a layer's activation memory at FFN
            ratio 4. Eager autograd only (torch.func and torch.compile save both). Off by default:
            slower (H200 training: ~4% fewer tokens/s for ~8% less memory; benchmarks/results/history/NOTES-diary.md).
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
    delta_TD, resid_TD, dbias = None, h_TD, None
    for p in layers[: len(layers) - int(last_anchor_only)]:
        delta_TD, resid_TD, dbias = layer(p, delta_TD, resid_TD, cu_seqlens, max_seqlen, kb_TH, cfg, ops,
                                          delta_bias=dbias, recompute_ffn=recompute_ffn)
    fnorm, eps = params.final_norm, cfg.norm_eps
    if last_anchor_only:
        delta_SD, resid_SD, dbias = layer(layers[-1], delta_TD, resid_TD, cu_seqlens, max_seqlen, kb_TH, cfg, ops,
                                          anchors_only=True, delta_bias=dbias, recompute_ffn=recompute_ffn)
        out_SD = _add_norm(ops, delta_SD, resid_SD, fnorm, eps, dbias)[0]
        z_TD = None
    else:
        if delta_TD is None:  # no layers
            z_TD = ops.layer_norm(resid_TD, fnorm.weight, fnorm.bias, eps)
        else:
            z_TD = _add_norm(ops, delta_TD, resid_TD, fnorm, eps, dbias)[0]
        if cfg.readout_mode == "anchor_only":
            out_SD = z_TD.index_select(0, cu_seqlens[:-1].long())
        else:
            r = params.readout_attention
            out_SD = ops.graph_readout(z_TD, r.weight, r.bias, cu_seqlens, max_seqlen)
    o = params.output_projection
    out_SO = ops.linear(out_SD, o.weight, o.bias)
    if cfg.should_l2_normalize_embedding_layer_output:
        out_SO = F.normalize(out_SO.float(), p=2.0, dim=-1).to(out_SO.dtype)
    return (out_SO, z_TD) if return_tokens else out_SO
