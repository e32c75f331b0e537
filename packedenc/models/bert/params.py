"""The BERT params tree (HF-named fields, (out, in) linear weights), its spec and random init."""

from __future__ import annotations

import torch
from torch import Tensor

from packedenc.errors import ConfigError
from packedenc.models.bert.config import BertConfig
from packedenc.pytree import Embedding, Linear, Norm, ParamSpec, pytree_dataclass, static


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


def init(cfg: BertConfig, generator: torch.Generator | None = None, *,
         heads: tuple[str, ...] = ("pooler",), dtype: torch.dtype = torch.float32) -> BertParams:
    """Random params (normal(0, initializer_range) weights, unit norms, zero biases)."""
    from packedenc.models.common import init_from_spec

    return init_from_spec(params_spec(cfg, heads=heads), cfg.initializer_range, generator, dtype)
