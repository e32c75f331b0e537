"""DeBERTa-v2/v3 (and mDeBERTa, deberta-v2-xlarge's conv layer) as a pure packed function.

Matches `transformers/models/deberta_v2/modeling_deberta_v2.py` of transformers 5.24 on real
tokens: post-LN layers, disentangled attention (content + c2p + p2c) with HF's log-bucketed
relative positions, computed inside each packed sequence (`ops.deberta_attention`), the ConvLayer
run per sequence with zero padding at both ends (`ops.varlen_conv1d`). Absolute positions (when
`position_biased_input`) restart at 0 in every sequence, which equals HF on right-padded batches.

Shapes: T packed tokens, S sequences, D hidden, E embedding size, H heads, K head dim,
F intermediate, V vocab, R = 2 * att_span relative-position rows.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import Tensor

from packedenc.errors import ConfigError, InputError
from packedenc.kernels import Ops, get_ops
from packedenc.kept import Kept, keepable
from packedenc.models.common import attention_dropout, dropout, prepare_inputs
from packedenc.models.deberta.config import DebertaConfig
from packedenc.models.deberta.params import ConvLayer, DebertaParams, Embeddings, Layer, SelfAttention
from packedenc.packing import longest_first, pool_first
from packedenc.pytree import tree_cast


def embed(p: Embeddings, ids_T: Tensor, positions_T: Tensor | None, token_type_ids_T: Tensor | None,
          cfg: DebertaConfig, ops: Ops) -> Tensor:
    """word (+ absolute position) (+ token type) -> embed_proj -> LayerNorm, summed in the params' dtype."""
    ln = p.layer_norm
    extras = p.position_embeddings is not None or p.token_type_embeddings is not None or p.embed_proj is not None
    if not extras:  # the v3 case: one fused gather + norm
        return ops.embed_layer_norm(ids_T, p.word_embeddings.weight, ln.weight, ln.bias, cfg.layer_norm_eps)
    x_TE = p.word_embeddings.weight[ids_T]
    if p.position_embeddings is not None:
        x_TE = x_TE + p.position_embeddings.weight[positions_T]
    if p.token_type_embeddings is not None:
        tt_T = ids_T.new_zeros(()).expand_as(ids_T) if token_type_ids_T is None else token_type_ids_T
        x_TE = x_TE + p.token_type_embeddings.weight[tt_T]
    if p.embed_proj is not None:  # before the LayerNorm, as in HF
        x_TE = ops.linear(x_TE, p.embed_proj.weight, None)
    return ops.layer_norm(x_TE, ln.weight, ln.bias, cfg.layer_norm_eps)


def rel_embeddings(params: DebertaParams, ops: Ops) -> Tensor | None:
    """(R, D) relative-position embeddings, LayerNorm-ed once per forward when norm_rel_ebd says so."""
    enc, cfg = params.encoder, params.config
    if enc.rel_embeddings is None or not cfg.attention_pos_types:
        return None
    rel_RD = enc.rel_embeddings.weight[: 2 * cfg.att_span]
    if enc.layer_norm is not None:
        rel_RD = ops.layer_norm(rel_RD, enc.layer_norm.weight, enc.layer_norm.bias, cfg.layer_norm_eps)
    return rel_RD


def position_projections(p: Layer, rel_RD: Tensor | None, cfg: DebertaConfig, ops: Ops,
                         seed: int | None = None, i: int = 0) -> tuple[Tensor | None, Tensor | None]:
    """One layer's (pos_key_RHK, pos_query_RHK) tables: its projections of the shared rel_RD, biases included.

    With share_att_key they are the layer's own key / query projections (row blocks of the fused
    qkv leaf), else the separate pos_key_proj / pos_query_proj. None for a term not in pos_att_type.
    `seed` (training) applies HF's per-layer `pos_dropout` to rel_RD first.
    """
    if rel_RD is None:
        return None, None
    rel_RD = dropout(rel_RD, cfg.hidden_dropout_prob, seed, i, 3)
    R, H, K = rel_RD.shape[0], cfg.num_attention_heads, cfg.head_dim
    HK, a = H * K, p.attention
    pk = pq = None
    if "c2p" in cfg.attention_pos_types:
        if cfg.share_att_key:
            w, b = a.qkv.weight[HK : 2 * HK], a.qkv.bias[HK : 2 * HK]
        else:
            w, b = a.pos_key_proj.weight, a.pos_key_proj.bias
        pk = ops.linear(rel_RD, w, b).view(R, H, K)
    if "p2c" in cfg.attention_pos_types:
        if cfg.share_att_key:
            w, b = a.qkv.weight[:HK], a.qkv.bias[:HK]
        else:
            w, b = a.pos_query_proj.weight, a.pos_query_proj.bias
        pq = ops.linear(rel_RD, w, b).view(R, H, K)
    return pk, pq


def _projection_blocks(a: SelfAttention, terms: tuple[str, ...], HK: int,
                       share_att_key: bool) -> list[tuple[Tensor, Tensor | None]]:
    """One layer's position projections as (weight, bias) row blocks, rows in `terms` order."""
    if share_att_key:  # the fused leaf's rows are query | key | value: p2c projects with query, c2p with key
        lo, hi = (0 if "p2c" in terms else HK), (2 * HK if "c2p" in terms else HK)
        return [(a.qkv.weight[lo:hi], None if a.qkv.bias is None else a.qkv.bias[lo:hi])]
    return [(x.weight, x.bias) for x in (a.pos_query_proj if t == "p2c" else a.pos_key_proj for t in terms)]


def position_tables(params: DebertaParams, rel_RD: Tensor | None, ops: Ops,
                    seed: int | None = None) -> list[tuple[Tensor | None, Tensor | None]]:
    """Every layer's (pos_key_RHK, pos_query_RHK) tables (as `position_projections`), in one GEMM.

    All the layers project the same rel_RD, so their projection blocks and biases are concatenated
    and applied in one `ops.linear`: one GEMM launch instead of one per layer and term (24 for a
    12-layer v3), which decides the host time of short batches. The tables are (R, H, K) views of
    its output (rows strided, head dim contiguous). The concatenation is part of autograd, so
    gradients reach each layer's own leaves; the weight copy it makes (2 * layers * H*K * D) is
    small next to a forward. With training dropout on (a seed and hidden_dropout_prob > 0) HF draws
    a pos_dropout mask per layer, so each layer projects its own dropped rel_RD instead.
    """
    cfg, layers = params.config, params.encoder.layer
    terms = tuple(t for t in ("p2c", "c2p") if t in cfg.attention_pos_types)  # query rows first
    if rel_RD is None or not terms or not layers:
        return [(None, None)] * len(layers)
    HK = cfg.num_attention_heads * cfg.head_dim
    blocks = [wb for p in layers for wb in _projection_blocks(p.attention, terms, HK, cfg.share_att_key)]
    mixed_bias = len({b is None for _, b in blocks}) > 1  # F.linear takes one bias or none
    if (seed is not None and cfg.hidden_dropout_prob > 0) or mixed_bias:
        return [position_projections(p, rel_RD, cfg, ops, seed, i) for i, p in enumerate(layers)]

    def cat(ts: list[Tensor]) -> Tensor:
        return ts[0] if len(ts) == 1 else torch.cat(ts)

    w = cat([w for w, _ in blocks])
    b = None if blocks[0][1] is None else cat([b for _, b in blocks])
    R, n, H, K = rel_RD.shape[0], len(terms), cfg.num_attention_heads, cfg.head_dim
    tabs = ops.linear(rel_RD, w, b).view(R, len(layers) * n, H, K).unbind(1)  # (R, H, K) each
    by_term = [dict(zip(terms, tabs[i * n : (i + 1) * n])) for i in range(len(layers))]
    return [(t.get("c2p"), t.get("p2c")) for t in by_term]


# Inference keeps each params tree's position tables: they depend on the weights only, and making
# them (a LayerNorm, two weight concatenations and a GEMM) is a tenth of the host time of a short
# eager batch. The params dataclasses have slots, so the leaves (tensors) are what is referenced.
_KEPT = Kept(max_entries=8)  # params trees; the oldest entry goes first


def _table_leaves(params: DebertaParams) -> list[Tensor]:
    """The tensors `rel_embeddings` and `position_tables` read."""
    enc, cfg = params.encoder, params.config
    out = [enc.rel_embeddings.weight] if enc.rel_embeddings is not None else []
    if enc.layer_norm is not None:
        out += [enc.layer_norm.weight, enc.layer_norm.bias]
    for p in enc.layer:
        a = p.attention
        mods = (a.qkv,) if cfg.share_att_key else (a.pos_key_proj, a.pos_query_proj)
        out += [t for m in mods if m is not None for t in (m.weight, m.bias)]
    return [t for t in out if t is not None]


def position_inputs(params: DebertaParams, ops: Ops, seed: int | None) -> tuple[Tensor | None, list]:
    """(rel_RD, `position_tables`) of one forward. Without gradients they are made once per params
    tree and reused while every tensor they come from is the same one at the same version (an
    in-place update, e.g. an optimizer step or `copy_`, makes them again) and the op table is the
    same; never under dropout, nor where `kept.keepable` says no (a trace, a side stream such as a
    CUDA-graph capture's, params made under `torch.inference_mode`)."""
    keep = seed is None and not torch.is_grad_enabled()
    leaves = _table_leaves(params) if keep else []
    keep = keep and keepable(leaves)
    if keep:
        hit = _KEPT.get(leaves, ops.chosen)
        if hit is not None:
            return hit
    rel_RD = rel_embeddings(params, ops)
    value = (rel_RD, position_tables(params, rel_RD, ops, seed))
    return _KEPT.put(leaves, ops.chosen, value) if keep else value


def layer(p: Layer, x_TD: Tensor, cu_seqlens: Tensor, max_seqlen: int, pos_key_RHK: Tensor | None,
          pos_query_RHK: Tensor | None, cfg: DebertaConfig, ops: Ops, i: int = 0,
          seed: int | None = None, seq_order: Tensor | None = None) -> Tensor:
    """One post-LN DeBERTa layer over a padding-free buffer. Pure: returns a new tensor.

    `seed` turns on HF's train-mode dropout sites: attention probabilities, attention output and
    FFN output (before their residual LayerNorms), masks drawn from (seed, layer i, site).
    `seq_order`: the attention kernel's sequence order (`packing.longest_first`), or None."""
    T, H, K = x_TD.shape[0], cfg.num_attention_heads, cfg.head_dim
    qkv_T3HK = ops.linear(x_TD, p.attention.qkv.weight, p.attention.qkv.bias).view(T, 3, H, K)
    drop = attention_dropout(cfg.attention_probs_dropout_prob, "attention_probs_dropout_prob", ops, seed, i,
                             op="deberta_attention")
    # unbind, not three slices: its backward stacks the three gradients into one (T, 3, H, K) tensor,
    # where each slice's backward is a zero-filled full-size tensor, summed three times
    # (benchmarks/results/history/deberta_train_unbind_h200.txt)
    q_THK, k_THK, v_THK = qkv_T3HK.unbind(1)
    o_THK = ops.deberta_attention(
        q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, pos_key_RHK, pos_query_RHK,
        pos_att_type=cfg.attention_pos_types, position_buckets=cfg.position_buckets,
        max_relative_positions=cfg.max_relative, scale=cfg.scale, seq_order=seq_order, **drop,
    )
    ao, out, p_drop = p.attention_output, p.output, cfg.hidden_dropout_prob
    y_TD = dropout(ops.linear(o_THK.reshape(T, H * K), ao.dense.weight, ao.dense.bias), p_drop, seed, i, 1)
    # post-LN: the sum is not kept, and y_TD (this layer's temporary) may take the norm's output
    a_TD, _ = ops.add_layer_norm(y_TD, x_TD, ao.layer_norm.weight, ao.layer_norm.bias, cfg.layer_norm_eps,
                                 keep_sum=False, overwrite_input=True)
    # the intermediate GEMM's output is this layer's own temporary: inference may overwrite it
    h_TF = ops.activation(ops.linear(a_TD, p.intermediate.weight, p.intermediate.bias), cfg.hidden_act,
                          overwrite_input=True)
    y_TD = dropout(ops.linear(h_TF, out.dense.weight, out.dense.bias), p_drop, seed, i, 2)
    return ops.add_layer_norm(y_TD, a_TD, out.layer_norm.weight, out.layer_norm.bias, cfg.layer_norm_eps,
                              keep_sum=False, overwrite_input=True)[0]


def conv_layer(p: ConvLayer, emb_TD: Tensor, layer0_TD: Tensor, cu_seqlens: Tensor, max_seqlen: int,
               cfg: DebertaConfig, ops: Ops, seed: int | None = None) -> Tensor:
    """HF ConvLayer: LayerNorm(layer0 + act(dropout(conv(embeddings)))), the conv zero-padded per sequence."""
    c_TD = ops.varlen_conv1d(emb_TD, p.conv.weight, p.conv.bias, cu_seqlens, max_seqlen, cfg.conv_groups)
    c_TD = ops.activation(dropout(c_TD, cfg.hidden_dropout_prob, seed, -2, 0), cfg.conv_act)
    return ops.add_layer_norm(layer0_TD, c_TD, p.layer_norm.weight, p.layer_norm.bias, cfg.layer_norm_eps,
                              keep_sum=False)[0]


def _check_token_types(tt: Tensor | None, ids: Tensor, cfg: DebertaConfig, values: bool) -> Tensor | None:
    if tt is None or cfg.type_vocab_size == 0:
        return None  # as HF: a model without token type embeddings ignores them
    if not isinstance(tt, Tensor) or tt.shape != ids.shape:
        shape = tuple(tt.shape) if isinstance(tt, Tensor) else type(tt).__name__
        raise InputError(f"token_type_ids must be a (T,) tensor like ids {tuple(ids.shape)}, got {shape}")
    if tt.is_floating_point() or tt.is_complex() or tt.dtype == torch.bool:
        raise InputError(f"token_type_ids must be an integer tensor, got {tt.dtype}")
    if tt.device != ids.device:
        raise InputError(f"token_type_ids is on {tt.device} but ids on {ids.device}; move both")
    if values:
        lo, hi = int(tt.min()), int(tt.max())
        if lo < 0 or hi >= cfg.type_vocab_size:
            raise InputError(
                f"token type id {lo if lo < 0 else hi} is outside [0, {cfg.type_vocab_size}) (type_vocab_size)"
            )
    return tt


def max_seqlen_limit(params: DebertaParams) -> int | None:
    """Longest sequence the absolute position table holds, when the model has one (`encode`
    refuses longer ones); relative positions alone set no limit."""
    return params.config.max_position_embeddings if params.embeddings.position_embeddings is not None else None


def encode(
    params: DebertaParams,
    ids: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int | None = None,
    positions: Tensor | None = None,
    *,
    token_type_ids: Tensor | None = None,
    backend: str | Ops = "auto",
    validate: bool = False,
    compute_dtype: torch.dtype | None = None,
    dropout_seed: int | None = None,
    checkpoint: bool = False,
) -> Tensor:
    """Last hidden state of every packed token.

    Arguments:
        params: a `DebertaParams` tree (from `packedenc.load` or `init`).
        ids: (T,) integer token ids, sequences back to back, no padding.
        cu_seqlens: (S+1,) int32 boundaries, starting at 0 and ending at T.
        max_seqlen: host int, the longest sequence; computed (one host sync) when None.
        positions: (T,) position inside each sequence (absolute embeddings only; derived when None).
        token_type_ids: (T,) optional segment ids, used when type_vocab_size > 0 (zeros when None),
            ignored otherwise, as in transformers.
        backend: "auto", "reference", ... or an `Ops` table.
        validate: check values of ids / cu_seqlens / token_type_ids even on a GPU (syncs).
        compute_dtype: run in this dtype (e.g. bf16) while params stay in theirs (fp32 master
            weights); gradients flow back to the original leaves.
        dropout_seed: None = no dropout (inference). An int turns on HF's train-mode dropout
            (hidden_dropout_prob on the embeddings, the relative embeddings of each layer, the
            attention and FFN outputs and the conv; attention_probs_dropout_prob on the attention
            probabilities, reference attention only) with masks derived from (seed, layer, site).
        checkpoint: recompute each layer in the backward pass instead of keeping its activations
            (torch.autograd only). The relative-position tables are still computed once per forward,
            outside the recomputed layers.
    Return:
        (T, D) in the compute dtype (the params' dtype when None).
    """
    cfg = params.config
    table = params.embeddings.position_embeddings is not None
    ids, cu_seqlens, max_seqlen, positions = prepare_inputs(
        ids, cu_seqlens, max_seqlen, positions, cfg.vocab_size, validate, need_positions=table,
        max_positions=cfg.max_position_embeddings if table else None, compute_dtype=compute_dtype,
        table=f"this model's absolute position embeddings (max_position_embeddings={cfg.max_position_embeddings})",
    )
    token_type_ids = _check_token_types(token_type_ids, ids, cfg, validate or ids.device.type == "cpu")
    if compute_dtype is not None:
        params = tree_cast(params, compute_dtype)
    ops, seed = get_ops(backend, ids.device), dropout_seed
    emb_TD = embed(params.embeddings, ids, positions, token_type_ids, cfg, ops)
    emb_TD = dropout(emb_TD, cfg.hidden_dropout_prob, seed, -1, 0)
    # Position tables depend on the weights only: computed once per forward, before the layers
    # (under `checkpoint` they are inputs of the recomputed layers, kept: (R, H, K) per layer);
    # without gradients, once per params tree (`position_inputs`).
    rel_RD, tables = position_inputs(params, ops, seed)
    # Longest sequences first: the attention kernel's programs then end in a full last wave
    # (computed once per forward; the CPU reference has no waves).
    seq_order = longest_first(cu_seqlens) if ids.is_cuda else None
    x_TD = emb_TD
    for i, (p, (pk, pq)) in enumerate(zip(params.encoder.layer, tables)):
        args = (p, x_TD, cu_seqlens, max_seqlen, pk, pq, cfg, ops, i, seed, seq_order)
        if checkpoint and torch.is_grad_enabled():
            x_TD = torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False)
        else:
            x_TD = layer(*args)
        if i == 0 and params.encoder.conv is not None:  # its input is the embedding output
            x_TD = conv_layer(params.encoder.conv, emb_TD, x_TD, cu_seqlens, max_seqlen, cfg, ops, seed)
    return x_TD


# ---- heads (pure functions of the same params) -------------------------------------------------


def classify(params: DebertaParams, hidden_TD: Tensor, cu_seqlens: Tensor, *,
             backend: str | Ops = "auto") -> Tensor:
    """(T, D) hidden -> (S, num_labels) logits: first token -> pooler dense -> act -> classifier.

    DebertaV2ForSequenceClassification's ContextPooler + classifier (dropouts are identities).
    """
    if params.classifier is None or params.pooler is None:
        raise ConfigError("these params have no classifier: load a DebertaV2ForSequenceClassification checkpoint")
    ops = get_ops(backend, hidden_TD.device)
    d, c = params.pooler.dense, params.classifier
    pooled_SD = ops.activation(ops.linear(pool_first(hidden_TD, cu_seqlens), d.weight, d.bias),
                               params.config.pooler_hidden_act)
    return ops.linear(pooled_SD, c.weight, c.bias)


def mlm_head(params: DebertaParams, hidden_TD: Tensor, *,
             backend: str | Ops = "auto") -> tuple[Tensor, Tensor, Tensor | None]:
    """(T, D) hidden -> (features (T, D), decoder weight (V, D), decoder bias (V,) or None).

    The MLM logits are `linear(features, weight, bias)` (`mlm_logits`); `losses.mlm_loss` hands the
    three to `ops.linear_cross_entropy`, which never keeps the (T, V) logits (V = 128,100 for v3).
    lm_predictions (Microsoft's head, HF legacy=False): LN(act(dense(h))), word_embeddings, bias.
    cls.predictions (HF legacy=True): LN(act(transform.dense(h))), the decoder (tied to the word
    embeddings unless tie_word_embeddings=False) and its bias.
    """
    cfg = params.config
    ops = get_ops(backend, hidden_TD.device)
    if params.lm_predictions is not None:
        head = params.lm_predictions.lm_head
        w, bias = params.embeddings.word_embeddings.weight, head.bias
    elif params.cls is not None:
        head = params.cls.predictions.transform
        dec = params.cls.predictions.decoder
        w = params.embeddings.word_embeddings.weight if dec is None else dec.weight
        bias = params.cls.predictions.bias if dec is None else dec.bias
    else:
        raise ConfigError("these params have no MLM head: load a DebertaV2ForMaskedLM checkpoint "
                          "(or one with lm_predictions.* tensors)")
    h = ops.activation(ops.linear(hidden_TD, head.dense.weight, head.dense.bias), cfg.hidden_act)
    return ops.layer_norm(h, head.layer_norm.weight, head.layer_norm.bias, cfg.layer_norm_eps), w, bias


def mlm_logits(params: DebertaParams, hidden_TD: Tensor, *, backend: str | Ops = "auto") -> Tensor:
    """(T, D) hidden -> (T, V) MLM logits from whichever MLM head the params carry (`mlm_head`).

    To score only masked positions, index `hidden_TD` first.
    """
    ops = get_ops(backend, hidden_TD.device)
    return ops.linear(*mlm_head(params, hidden_TD, backend=ops))
