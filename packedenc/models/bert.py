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

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

from packedenc.errors import ConfigError, InputError
from packedenc.kernels import Ops, get_ops
from packedenc.kernels.reference import check_activation
from packedenc.models.common import attention_dropout, dropout, prepare_inputs
from packedenc.packing import pool_first
from packedenc.pytree import Embedding, Linear, Norm, ParamSpec, pytree_dataclass, static, tree_cast

MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
ROBERTA_TYPES = ("roberta", "xlm-roberta")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BertConfig:
    model_type: str = "bert"  # "bert" | "roberta" | "xlm-roberta": decides the position offset
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1  # training only (with `dropout_seed`), as HF's train mode
    attention_probs_dropout_prob: float = 0.1
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    tie_word_embeddings: bool = True
    id2label: tuple[tuple[int, str], ...] = ()  # classifier label names, kept for round trips
    architectures: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"not a BERT-family model_type: {self.model_type!r}; expected one of {MODEL_TYPES}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.is_roberta and self.pad_token_id is None:
            raise ConfigError(f"{self.model_type} needs pad_token_id: its positions start at pad_token_id + 1")
        if self.max_positions <= 0:
            raise ConfigError(
                f"max_position_embeddings {self.max_position_embeddings} leaves no position after the "
                f"offset {self.position_offset}"
            )
        check_activation(self.hidden_act)

    @property
    def is_roberta(self) -> bool:
        return self.model_type in ROBERTA_TYPES

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def position_offset(self) -> int:
        """Row of the position table used for position 0 (pad_token_id + 1 for RoBERTa / XLM-R)."""
        return self.pad_token_id + 1 if self.is_roberta else 0

    @property
    def max_positions(self) -> int:
        """Longest sequence the position table can hold (512 for bert-base and roberta-base)."""
        return self.max_position_embeddings - self.position_offset

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "BertConfig":
        """Build from an HF config.json dict. Raises `ConfigError` on what the math does not honour."""
        if d.get("model_type") not in MODEL_TYPES:
            raise ConfigError(f"not a BERT / RoBERTa / XLM-R config: model_type={d.get('model_type')!r}")
        pet = d.get("position_embedding_type", "absolute")
        if pet not in (None, "absolute"):
            raise ConfigError(
                f"position_embedding_type={pet!r} is not supported (absolute positions only); "
                "transformers 5 dropped relative_key(_query) as well"
            )
        for flag in ("is_decoder", "add_cross_attention"):
            if d.get(flag):
                raise ConfigError(f"{flag}=true is not supported: packedenc runs BERT as a bidirectional encoder")
        act = d.get("hidden_act", "gelu")
        if not isinstance(act, str):
            raise ConfigError(f"hidden_act must be a name, got {act!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names and k not in ("id2label", "architectures")}
        for k in ("eos_token_id", "bos_token_id"):
            if isinstance(kw.get(k), list):
                kw[k] = kw[k][0] if kw[k] else None
        id2label = tuple(sorted((int(k), str(v)) for k, v in (d.get("id2label") or {}).items()))
        return cls(**kw, id2label=id2label, architectures=tuple(d.get("architectures") or ()))

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers loads to the same model."""
        d = dataclasses.asdict(self)
        d["position_embedding_type"] = "absolute"
        d["architectures"] = list(self.architectures) or [_ARCH_PREFIX[self.model_type] + "Model"]
        if self.id2label:
            d["id2label"] = {str(i): n for i, n in self.id2label}
            d["label2id"] = {n: i for i, n in self.id2label}
        else:
            d.pop("id2label")
        return d


_ARCH_PREFIX = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}

PRESETS = {
    "tiny": BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=64),
    "minilm-l6": BertConfig(hidden_size=384, num_hidden_layers=6, intermediate_size=1536),
    "base": BertConfig(),
}


# ---- params -----------------------------------------------------------------------------------


@pytree_dataclass
class Embeddings:  # HF: embeddings.*
    word_embeddings: Embedding  # (V, D)
    position_embeddings: Embedding  # (max_position_embeddings, D)
    token_type_embeddings: Embedding  # (type_vocab_size, D)
    layer_norm: Norm  # HF: embeddings.LayerNorm


@pytree_dataclass
class AddNorm:  # HF: attention.output.* and output.*: LayerNorm(dense(x) + residual)
    dense: Linear
    layer_norm: Norm  # HF: LayerNorm


@pytree_dataclass
class Attention:  # HF: encoder.layer.{i}.attention.*
    qkv: Linear  # (3*D, D): self.query | self.key | self.value, fused once at load
    output: AddNorm  # (D, D)


@pytree_dataclass
class Intermediate:  # HF: encoder.layer.{i}.intermediate.*
    dense: Linear  # (F, D)


@pytree_dataclass
class Layer:  # HF: encoder.layer.{i}.*
    attention: Attention
    intermediate: Intermediate
    output: AddNorm  # dense (D, F)


@pytree_dataclass
class MlmHead:  # BERT: cls.predictions.{transform.dense, transform.LayerNorm, bias}; RoBERTa: lm_head.*
    dense: Linear
    norm: Norm
    bias: Tensor  # (V,)
    decoder: Tensor | None = None  # (V, D); None: tied to the word embeddings


@pytree_dataclass
class Classifier:  # BERT: classifier (on the pooler); RoBERTa: classifier.{dense, out_proj} (on <s>)
    out_proj: Linear  # (num_labels, D)
    dense: Linear | None = None  # RoBERTa only: (D, D) then tanh


@pytree_dataclass
class BertParams:
    embeddings: Embeddings
    layers: tuple[Layer, ...]
    pooler: Linear | None = None  # HF: pooler.dense; tanh(dense(first token))
    mlm: MlmHead | None = None
    classifier: Classifier | None = None
    config: BertConfig = static(None)


def params_spec(cfg: BertConfig, *, heads: tuple[str, ...] = ("pooler",)) -> BertParams:
    """The params tree with `ParamSpec` leaves. `heads`: any of "pooler", "mlm", "classifier"."""
    D, F_, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    bad = set(heads) - {"pooler", "mlm", "classifier"}
    if bad:
        raise ConfigError(f"unknown BERT heads {sorted(bad)}; choose from pooler, mlm, classifier")

    def lin(o: int, i: int) -> Linear:
        return Linear(ParamSpec((o, i)), ParamSpec((o,), "zeros"))

    def norm() -> Norm:
        return Norm(ParamSpec((D,), "ones"), ParamSpec((D,), "zeros"))

    layers = tuple(
        Layer(
            attention=Attention(qkv=lin(3 * D, D), output=AddNorm(lin(D, D), norm())),
            intermediate=Intermediate(lin(F_, D)),
            output=AddNorm(lin(D, F_), norm()),
        )
        for _ in range(cfg.num_hidden_layers)
    )
    mlm = None
    if "mlm" in heads:
        decoder = None if cfg.tie_word_embeddings else ParamSpec((V, D))
        mlm = MlmHead(lin(D, D), norm(), ParamSpec((V,), "zeros"), decoder)
    classifier = None
    if "classifier" in heads:
        classifier = Classifier(lin(cfg.num_labels or 2, D), lin(D, D) if cfg.is_roberta else None)
    # BertForSequenceClassification classifies the pooler output, so it always has a pooler.
    has_pooler = "pooler" in heads or (classifier is not None and not cfg.is_roberta)
    return BertParams(
        embeddings=Embeddings(
            Embedding(ParamSpec((V, D))),
            Embedding(ParamSpec((cfg.max_position_embeddings, D))),
            Embedding(ParamSpec((cfg.type_vocab_size, D))),
            norm(),
        ),
        layers=layers,
        pooler=lin(D, D) if has_pooler else None,
        mlm=mlm,
        classifier=classifier,
        config=cfg,
    )


# ---- forward ----------------------------------------------------------------------------------


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
    x_TD, _ = ops.add_layer_norm(a_TD, x_TD, o.layer_norm.weight, o.layer_norm.bias, cfg.layer_norm_eps,
                                 keep_sum=False)

    d = p.intermediate.dense
    h_TF = ops.activation(ops.linear(x_TD, d.weight, d.bias), cfg.hidden_act)
    o = p.output
    m_TD = dropout(ops.linear(h_TF, o.dense.weight, o.dense.bias), cfg.hidden_dropout_prob, seed, i, 2)
    x_TD, _ = ops.add_layer_norm(m_TD, x_TD, o.layer_norm.weight, o.layer_norm.bias, cfg.layer_norm_eps,
                                 keep_sum=False)
    return x_TD


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
        backend: "auto", "reference", "triton", "flash", "cute", or an `Ops` table.
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


def mlm_logits(params: BertParams, hidden_TD: Tensor, *, backend: str | Ops = "auto") -> Tensor:
    """(T, D) hidden -> (T, V) MLM logits: dense, act, LayerNorm, then the (tied) decoder + bias.

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
    return ops.linear(h_TD, w, m.bias)


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


def init(cfg: BertConfig, generator: torch.Generator | None = None, *,
         heads: tuple[str, ...] = ("pooler",), dtype: torch.dtype = torch.float32) -> BertParams:
    """Random params (normal(0, initializer_range) weights, unit norms, zero biases)."""
    from packedenc.models.common import init_from_spec

    return init_from_spec(params_spec(cfg, heads=heads), cfg.initializer_range, generator, dtype)


def config_from_hf(d: dict[str, Any]) -> BertConfig:
    return BertConfig.from_hf(d)
