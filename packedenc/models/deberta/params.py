"""DeBERTa-v2/v3 params tree: HF submodule names in snake_case (the converter maps `layer_norm` to
`LayerNorm`, `attention` to `attention.self`, ...), linear weights in HF's (out, in) layout.

One fusion: the query / key / value projections of a layer are one (3*H*K, D) leaf `qkv`
(one GEMM; the converter concatenates and splits them back bit for bit).

Shapes: D hidden, E embedding size, H heads, K head dim, F intermediate, V vocab, P absolute
positions, R = 2 * att_span relative-position rows, k conv kernel, C = D / conv_groups.
"""

from __future__ import annotations

import torch
from torch import Tensor

from packedenc.errors import ConfigError
from packedenc.models.deberta.config import DebertaConfig
from packedenc.pytree import Embedding, Linear, Norm, ParamSpec, pytree_dataclass, static

HEADS = ("classifier", "mlm", "mlm_legacy")


@pytree_dataclass
class Embeddings:  # HF: deberta.embeddings.*
    word_embeddings: Embedding  # (V, E)
    layer_norm: Norm  # (D,), applied after embed_proj
    position_embeddings: Embedding | None = None  # (P, E), only with position_biased_input
    token_type_embeddings: Embedding | None = None  # (type_vocab_size, E), only when > 0
    embed_proj: Linear | None = None  # (D, E), no bias, only when E != D


@pytree_dataclass
class SelfAttention:  # HF: encoder.layer.{i}.attention.self.*
    qkv: Linear  # (3*H*K, D): rows query_proj | key_proj | value_proj, heads contiguous
    pos_key_proj: Linear | None = None  # (H*K, D), separate c2p projection (share_att_key=False)
    pos_query_proj: Linear | None = None  # (H*K, D), separate p2c projection (share_att_key=False)


@pytree_dataclass
class DenseNorm:  # HF: *.output.*  ->  LayerNorm(dense(x) + residual)
    dense: Linear
    layer_norm: Norm


@pytree_dataclass
class Layer:  # HF: encoder.layer.{i}.*
    attention: SelfAttention  # HF: attention.self
    attention_output: DenseNorm  # HF: attention.output; dense (D, H*K)
    intermediate: Linear  # HF: intermediate.dense, (F, D)
    output: DenseNorm  # HF: output; dense (D, F)


@pytree_dataclass
class Conv1d:
    weight: Tensor  # (D, C, k), nn.Conv1d layout
    bias: Tensor  # (D,)


@pytree_dataclass
class ConvLayer:  # HF: encoder.conv.*  (deberta-v2-xlarge / xxlarge)
    conv: Conv1d
    layer_norm: Norm


@pytree_dataclass
class Encoder:  # HF: deberta.encoder.*
    layer: tuple[Layer, ...]
    rel_embeddings: Embedding | None = None  # (R, D), only with relative_attention
    layer_norm: Norm | None = None  # LayerNorm of rel_embeddings ("layer_norm" in norm_rel_ebd)
    conv: ConvLayer | None = None


@pytree_dataclass
class Pooler:  # HF: pooler.*  (ContextPooler: first token -> dense -> act)
    dense: Linear  # (D, D)


@pytree_dataclass
class LmHead:  # HF: lm_predictions.lm_head.*  (legacy=False MLM head, shipped by Microsoft)
    dense: Linear  # (D, D)
    layer_norm: Norm
    bias: Tensor  # (V,); the decoder is the word embedding matrix


@pytree_dataclass
class LmPredictions:  # HF: lm_predictions.*
    lm_head: LmHead


@pytree_dataclass
class Transform:  # HF: cls.predictions.transform.*
    dense: Linear  # (E, D)
    layer_norm: Norm  # (E,)


@pytree_dataclass
class LegacyPredictions:  # HF: cls.predictions.*  (legacy=True MLM head, transformers' default)
    transform: Transform
    bias: Tensor  # (V,), the decoder's bias when tied
    decoder: Linear | None = None  # (V, E) + (V,), only with tie_word_embeddings=False


@pytree_dataclass
class LegacyCls:  # HF: cls.*
    predictions: LegacyPredictions


@pytree_dataclass
class DebertaParams:
    embeddings: Embeddings
    encoder: Encoder
    pooler: Pooler | None = None  # sequence classification
    classifier: Linear | None = None  # (num_labels, D)
    lm_predictions: LmPredictions | None = None  # MLM, legacy=False layout
    cls: LegacyCls | None = None  # MLM, legacy=True layout
    config: DebertaConfig = static(None)


def params_spec(cfg: DebertaConfig, *, heads: tuple[str, ...] = ()) -> DebertaParams:
    """The params tree with `ParamSpec` leaves.

    Arguments:
        heads: any of "classifier" (pooler + classifier), "mlm" (lm_predictions) and
            "mlm_legacy" (cls.predictions, what transformers' DebertaV2ForMaskedLM builds by default).
    """
    bad = set(heads) - set(HEADS)
    if bad:
        raise ConfigError(f"unknown DeBERTa head(s) {sorted(bad)}; choose from {HEADS}")
    D, E, F, V, HK = cfg.hidden_size, cfg.emb_size, cfg.intermediate_size, cfg.vocab_size, cfg.hidden_size

    def lin(o: int, i: int, bias: bool = True) -> Linear:
        return Linear(ParamSpec((o, i)), ParamSpec((o,), "zeros") if bias else None)

    def norm(n: int = D) -> Norm:
        return Norm(ParamSpec((n,), "ones"), ParamSpec((n,), "zeros"))

    rel = cfg.relative_attention
    separate = rel and not cfg.share_att_key

    def layer() -> Layer:
        return Layer(
            attention=SelfAttention(
                qkv=lin(3 * HK, D),
                pos_key_proj=lin(HK, D) if separate and "c2p" in cfg.pos_att_type else None,
                pos_query_proj=lin(HK, D) if separate and "p2c" in cfg.pos_att_type else None,
            ),
            attention_output=DenseNorm(lin(D, HK), norm()),
            intermediate=lin(F, D),
            output=DenseNorm(lin(D, F), norm()),
        )

    k = cfg.conv_kernel_size
    conv = None
    if k:
        conv = ConvLayer(Conv1d(ParamSpec((D, D // cfg.conv_groups, k)), ParamSpec((D,), "zeros")), norm())
    embeddings = Embeddings(
        word_embeddings=Embedding(ParamSpec((V, E))),
        layer_norm=norm(),
        position_embeddings=Embedding(ParamSpec((cfg.max_position_embeddings, E))) if cfg.position_biased_input else None,
        token_type_embeddings=Embedding(ParamSpec((cfg.type_vocab_size, E))) if cfg.type_vocab_size else None,
        embed_proj=lin(D, E, bias=False) if E != D else None,
    )
    encoder = Encoder(
        layer=tuple(layer() for _ in range(cfg.num_hidden_layers)),
        rel_embeddings=Embedding(ParamSpec((2 * cfg.att_span, D))) if rel else None,
        layer_norm=norm() if "layer_norm" in cfg.norm_rel_ebd_parts else None,
        conv=conv,
    )
    lm = None
    if "mlm" in heads:
        if E != D:
            raise ConfigError(
                f"the lm_predictions MLM head multiplies hidden states ({D}) by the word embeddings ({E}); "
                "it needs embedding_size == hidden_size (use the legacy cls.predictions head instead)"
            )
        lm = LmPredictions(LmHead(lin(D, D), norm(), ParamSpec((V,), "zeros")))
    legacy = None
    if "mlm_legacy" in heads:
        decoder = None if cfg.tie_word_embeddings else lin(V, E)
        legacy = LegacyCls(LegacyPredictions(Transform(lin(E, D), norm(E)), ParamSpec((V,), "zeros"), decoder))
    classify = "classifier" in heads
    return DebertaParams(
        embeddings=embeddings,
        encoder=encoder,
        pooler=Pooler(lin(D, D)) if classify else None,
        classifier=lin(cfg.num_labels, D) if classify else None,
        lm_predictions=lm,
        cls=legacy,
        config=cfg,
    )


def init(cfg: DebertaConfig, generator: torch.Generator | None = None, *,
         heads: tuple[str, ...] = (), dtype: torch.dtype = torch.float32) -> DebertaParams:
    """Random params (normal(0, initializer_range) weights, unit norms, zero biases)."""
    from packedenc.models.common import init_from_spec

    return init_from_spec(params_spec(cfg, heads=heads), cfg.initializer_range, generator, dtype)
