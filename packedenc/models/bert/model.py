"""BERT, RoBERTa and XLM-RoBERTa as one pure packed function.

Matches `transformers/models/{bert,roberta,xlm_roberta}/modeling_*.py` of transformers 5.24
(eager attention): word + token-type + absolute position embeddings -> LayerNorm, then post-norm
layers (LayerNorm(x + attn(x)), LayerNorm(x + ffn(x))) with the config's activation, and an
optional tanh pooler over the first token.

Positions restart at 0 in every packed sequence, which equals HF on right-padded batches.
RoBERTa / XLM-R number positions from `pad_token_id + 1` (fairseq's `make_positions`), so the
position table is read at `position + pad_token_id + 1`. HF skips pad tokens *inside* a sequence
when counting; packed batches have no pad tokens, so the two agree on everything a tokenizer
produces.

Shapes: T packed tokens, S sequences, D hidden, H heads, K head dim, F mlp width, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

from packedenc.errors import ConfigError, InputError
from packedenc.kernels import Ops, get_ops
from packedenc.models.bert.config import BertConfig
from packedenc.models.bert.params import BertParams, Embeddings, Layer
from packedenc.models.common import attention_dropout, dropout, prepare_inputs
from packedenc.packing import pool_first
from packedenc.pytree import tree_cast


def embed_tokens(p: Embeddings, ids_T: Tensor, positions_T: Tensor, token_type_ids_T: Tensor | None,
          cfg: BertConfig, ops: Ops) -> Tensor:
    """word + token type + position embeddings, then LayerNorm (HF's order of additions)."""
    x_TD = F.embedding(ids_T, p.word_embeddings.weight)
    if token_type_ids_T is None:  # HF's default: every token is type 0
        x_TD = x_TD + p.token_type_embeddings.weight[0]
    else:
        x_TD = x_TD + F.embedding(token_type_ids_T, p.token_type_embeddings.weight)
    x_TD = x_TD + F.embedding(positions_T + cfg.position_offset, p.position_embeddings.weight)
    return ops.layer_norm(x_TD, p.layer_norm.weight, p.layer_norm.bias, cfg.layer_norm_eps)


def layer(p: Layer, x_TD: Tensor, cu_seqlens: Tensor, max_seqlen: int, cfg: BertConfig, ops: Ops,
          i: int = 0, seed: int | None = None) -> Tensor:
    """One post-norm BERT layer over a padding-free buffer. Pure: returns a new tensor.
    `seed` turns on HF's train-mode dropout sites (attention probs, both sub-layer outputs)."""
    T, H, K = x_TD.shape[0], cfg.num_attention_heads, cfg.head_dim
    qkv_T3HK = ops.linear(x_TD, p.attention.qkv.weight, p.attention.qkv.bias).view(T, 3, H, K)
    q_THK, k_THK, v_THK = qkv_T3HK.unbind(1)
    drop = attention_dropout(cfg.attention_probs_dropout_prob, "attention_probs_dropout_prob", ops, seed, i)
    o_THK = ops.varlen_attention(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, **drop)
    o = p.attention.output
    a_TD = dropout(ops.linear(o_THK.reshape(T, H * K), o.dense.weight, o.dense.bias), cfg.hidden_dropout_prob, seed, i, 1)
    # post-LN: the sum is not kept, and a_TD (this layer's temporary) may take the norm's output
    x_TD, _ = ops.add_layer_norm(a_TD, x_TD, o.layer_norm.weight, o.layer_norm.bias, cfg.layer_norm_eps,
                                 keep_sum=False, overwrite_input=True)

    d = p.intermediate.dense
    h_TF = ops.activation(ops.linear(x_TD, d.weight, d.bias), cfg.hidden_act)
    o = p.output
    m_TD = dropout(ops.linear(h_TF, o.dense.weight, o.dense.bias), cfg.hidden_dropout_prob, seed, i, 2)
    x_TD, _ = ops.add_layer_norm(m_TD, x_TD, o.layer_norm.weight, o.layer_norm.bias, cfg.layer_norm_eps,
                                 keep_sum=False, overwrite_input=True)
    return x_TD


def max_seqlen_limit(params: BertParams) -> int:
    """Longest sequence the absolute position table holds (`encode` refuses longer ones)."""
    return params.config.max_positions


def encode(
    params: BertParams,
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
        params: a `BertParams` tree (from `packedenc.load` or `init`).
        ids: (T,) integer token ids, sequences back to back, no padding.
        cu_seqlens: (S+1,) int32 boundaries, starting at 0 and ending at T.
        max_seqlen: host int, the longest sequence; computed (one host sync) when None.
        positions: (T,) 0-based position inside each sequence; derived from cu_seqlens when None.
            RoBERTa's offset (pad_token_id + 1) is added here, never by the caller.
        token_type_ids: (T,) segment ids (0 / 1 for sentence pairs); None means all 0.
        backend: "auto", "reference", "triton", "flash", or an `Ops` table.
        validate: check values of ids / cu_seqlens / token types even on a GPU (syncs).
        compute_dtype: run in this dtype (e.g. bf16) while params stay in theirs (fp32 master weights).
        dropout_seed: None = no dropout (inference). An int turns on the config's hidden / attention
            dropout with masks derived from (seed, layer, site), reproducible under `checkpoint`.
        checkpoint: recompute each layer in the backward pass instead of keeping its activations.
    Return:
        (T, D) in the compute dtype (default: the params' dtype).
    """
    cfg = params.config
    # max_positions turns an index error deep in F.embedding (or a CUDA assert) into a message.
    ids, cu_seqlens, max_seqlen, positions = prepare_inputs(
        ids, cu_seqlens, max_seqlen, positions, cfg.vocab_size, validate, max_positions=cfg.max_positions,
        table=f"this {cfg.model_type} model's position table (max_position_embeddings="
              f"{cfg.max_position_embeddings}" + (f", less pad_token_id + 1 = {cfg.position_offset})"
                                                  if cfg.position_offset else ")"),
        compute_dtype=compute_dtype,
    )
    if token_type_ids is not None:
        _check_token_types(token_type_ids, ids, cfg, validate)
    if compute_dtype is not None:
        params = tree_cast(params, compute_dtype)
    ops = get_ops(backend, ids.device)
    x_TD = embed_tokens(params.embeddings, ids, positions, token_type_ids, cfg, ops)
    x_TD = dropout(x_TD, cfg.hidden_dropout_prob, dropout_seed, -1, 0)
    for i, p in enumerate(params.layers):
        args = (p, x_TD, cu_seqlens, max_seqlen, cfg, ops, i, dropout_seed)
        if checkpoint and torch.is_grad_enabled():
            x_TD = torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False)
        else:
            x_TD = layer(*args)
    return x_TD


def _check_token_types(tt: Tensor, ids: Tensor, cfg: BertConfig, validate: bool) -> None:
    if not isinstance(tt, Tensor) or tt.shape != ids.shape or tt.is_floating_point() or tt.dtype == torch.bool:
        raise InputError(
            f"token_type_ids must be an integer tensor shaped like ids {tuple(ids.shape)}, got "
            f"{getattr(tt, 'dtype', type(tt).__name__)} {tuple(getattr(tt, 'shape', ()))}"
        )
    if tt.device != ids.device:
        raise InputError(f"token_type_ids is on {tt.device} but ids on {ids.device}; move both")
    if validate or tt.device.type == "cpu":
        lo, hi = int(tt.min()), int(tt.max())
        if lo < 0 or hi >= cfg.type_vocab_size:
            raise InputError(f"token type {hi if hi >= cfg.type_vocab_size else lo} is outside "
                             f"[0, {cfg.type_vocab_size}) (type_vocab_size of this model)")


# ---- heads (pure functions of the same params) -------------------------------------------------


def pooler(params: BertParams, hidden_TD: Tensor, cu_seqlens: Tensor, *, backend: str | Ops = "auto") -> Tensor:
    """(T, D) hidden -> (S, D): tanh(dense(first token of each sequence)), HF's `pooler_output`."""
    if params.pooler is None:
        raise ConfigError("these params have no pooler (the checkpoint has no pooler.dense weights)")
    ops = get_ops(backend, hidden_TD.device)
    first_SD = pool_first(hidden_TD, cu_seqlens)
    return ops.activation(ops.linear(first_SD, params.pooler.weight, params.pooler.bias), "tanh")


def mlm_head(params: BertParams, hidden_TD: Tensor, *,
             backend: str | Ops = "auto") -> tuple[Tensor, Tensor, Tensor | None]:
    """(T, D) hidden -> (features (T, D), decoder weight (V, D), decoder bias (V,) or None):
    dense, act, LayerNorm, and the (tied) decoder. The MLM logits are `linear(features, weight,
    bias)` (`mlm_logits`); `losses.mlm_loss` hands these three to `ops.linear_cross_entropy`, which
    never keeps the (T, V) logits.

    BERT's transform uses `hidden_act`; RoBERTa's lm_head always uses exact GELU. To score only
    some tokens (masked positions), index `hidden_TD` before calling.
    """
    if params.mlm is None:
        raise ConfigError("these params have no MLM head: load a ...ForMaskedLM checkpoint")
    cfg, m = params.config, params.mlm
    ops = get_ops(backend, hidden_TD.device)
    act = "gelu" if cfg.is_roberta else cfg.hidden_act
    h_TD = ops.activation(ops.linear(hidden_TD, m.dense.weight, m.dense.bias), act)
    h_TD = ops.layer_norm(h_TD, m.norm.weight, m.norm.bias, cfg.layer_norm_eps)
    w = params.embeddings.word_embeddings.weight if m.decoder is None else m.decoder
    return h_TD, w, m.bias


def mlm_logits(params: BertParams, hidden_TD: Tensor, *, backend: str | Ops = "auto") -> Tensor:
    """(T, D) hidden -> (T, V) MLM logits: `linear` of `mlm_head`'s three."""
    ops = get_ops(backend, hidden_TD.device)
    return ops.linear(*mlm_head(params, hidden_TD, backend=ops))


def classify(params: BertParams, hidden_TD: Tensor, cu_seqlens: Tensor, *,
             backend: str | Ops = "auto") -> Tensor:
    """(T, D) hidden -> (S, num_labels) logits.

    BERT: classifier(pooler(first token)). RoBERTa / XLM-R: out_proj(tanh(dense(first token))).
    """
    if params.classifier is None:
        raise ConfigError("these params have no classifier: load a ...ForSequenceClassification checkpoint")
    ops = get_ops(backend, hidden_TD.device)
    c = params.classifier
    if c.dense is None:
        x_SD = pooler(params, hidden_TD, cu_seqlens, backend=ops)
    else:
        x_SD = ops.activation(ops.linear(pool_first(hidden_TD, cu_seqlens), c.dense.weight, c.dense.bias), "tanh")
    return ops.linear(x_SD, c.out_proj.weight, c.out_proj.bias)
