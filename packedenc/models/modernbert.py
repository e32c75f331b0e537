"""ModernBERT (and Ettin, mmBERT, gte-modernbert, ModernColBERT) as a pure packed function.

Matches `transformers/models/modernbert/modeling_modernbert.py` of transformers 5.24 (eager /
SDPA numerics: RoPE cos/sin rounded to the activation dtype, rotation in fp32). Positions restart
at 0 in every packed sequence, which equals HF on right-padded batches.

Shapes: T packed tokens, S sequences, D hidden, H heads, K head dim, F mlp width, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from packedenc.errors import ConfigError
from packedenc.kernels import Ops, get_ops
from packedenc.kernels.reference import check_activation
import torch.utils.checkpoint

from packedenc.models.common import attention_dropout, dropout, prepare_inputs
from packedenc.packing import pool_first, pool_mean
from packedenc.pytree import Embedding, Linear, Norm, ParamSpec, pytree_dataclass, static, tree_cast

MODEL_TYPES = ("modernbert",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModernBertConfig:
    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    hidden_activation: str = "gelu"
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    local_attention: int = 128  # TOTAL window: local layers see |i - j| <= local_attention // 2
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention", one per layer
    global_rope_theta: float = 160000.0
    local_rope_theta: float = 10000.0
    pad_token_id: int | None = 50283
    bos_token_id: int | None = 50281
    eos_token_id: int | None = 50282
    cls_token_id: int | None = 50281
    sep_token_id: int | None = 50282
    decoder_bias: bool = True
    classifier_pooling: str = "cls"
    classifier_bias: bool = False
    classifier_activation: str = "gelu"
    tie_word_embeddings: bool = True
    embedding_dropout: float = 0.0  # training only (with `dropout_seed`)
    attention_dropout: float = 0.0
    mlp_dropout: float = 0.0
    id2label: tuple[tuple[int, str], ...] = ()  # classifier label names, kept for round trips
    architectures: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", _layer_types(self.num_hidden_layers, 3))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        bad = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if bad:
            raise ConfigError(f"unsupported ModernBERT layer_types {sorted(bad)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.local_attention < 0 or self.local_attention % 2:
            raise ConfigError(f"local_attention must be a positive even number, got {self.local_attention}")
        if self.classifier_pooling not in ("cls", "mean"):
            raise ConfigError(f"classifier_pooling must be 'cls' or 'mean', got {self.classifier_pooling!r}")
        check_activation(self.hidden_activation)
        check_activation(self.classifier_activation)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    def is_global_layer(self, i: int) -> bool:
        return self.layer_types[i] == "full_attention"

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModernBertConfig":
        """Build from an HF config.json dict (4.x and 5.x schemas). Raises on what we can't honour."""
        if d.get("model_type") not in MODEL_TYPES:
            raise ConfigError(f"not a ModernBERT config: model_type={d.get('model_type')!r}")
        layer_types = d.get("layer_types")
        if layer_types is None:
            n = d.get("global_attn_every_n_layers", 3) or 3
            layer_types = _layer_types(d.get("num_hidden_layers", 22), n)
        global_theta, local_theta = _rope_thetas(d)
        if "head_dim" in d and d["head_dim"] not in (None, d.get("hidden_size", 768) // d.get("num_attention_heads", 12)):
            raise ConfigError(f"head_dim {d['head_dim']} != hidden_size / num_attention_heads is not supported")
        names = {f.name for f in dataclasses.fields(cls)}
        skip = ("layer_types", "id2label", "architectures", "global_rope_theta", "local_rope_theta")
        kw = {k: v for k, v in d.items() if k in names and k not in skip}
        for k in ("eos_token_id", "bos_token_id"):
            if isinstance(kw.get(k), list):
                kw[k] = kw[k][0] if kw[k] else None
        id2label = tuple(sorted((int(k), str(v)) for k, v in (d.get("id2label") or {}).items()))
        return cls(
            **kw,
            layer_types=tuple(layer_types),
            global_rope_theta=global_theta,
            local_rope_theta=local_theta,
            id2label=id2label,
            architectures=tuple(d.get("architectures") or ()),
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers (4.57+ and 5.x) loads to the same model."""
        d = dataclasses.asdict(self)
        d.pop("global_rope_theta"), d.pop("local_rope_theta")
        d["model_type"] = "modernbert"
        d["layer_types"] = list(self.layer_types)
        d["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": self.global_rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": self.local_rope_theta},
        }
        # 4.x reads these two; 5.x folds them into rope_parameters (which wins when both exist).
        d["global_rope_theta"], d["local_rope_theta"] = self.global_rope_theta, self.local_rope_theta
        d["architectures"] = list(self.architectures)  # `save` sets it from the heads present
        if self.id2label:
            d["id2label"] = {str(i): n for i, n in self.id2label}
            d["label2id"] = {n: i for i, n in self.id2label}
        else:
            d.pop("id2label")
        return d


def _layer_types(n_layers: int, every: int) -> tuple[str, ...]:
    return tuple("sliding_attention" if i % every else "full_attention" for i in range(n_layers))


def _rope_thetas(d: dict[str, Any]) -> tuple[float, float]:
    rp = d.get("rope_parameters")
    if d.get("rope_scaling"):
        raise ConfigError(f"rope_scaling {d['rope_scaling']} is not supported (default RoPE only)")
    if rp:
        thetas = []
        for kind, legacy, default in (("full_attention", "global_rope_theta", 160000.0),
                                      ("sliding_attention", "local_rope_theta", 10000.0)):
            p = rp.get(kind) or {}
            if p.get("rope_type", "default") != "default":
                raise ConfigError(f"rope_type {p['rope_type']!r} for {kind} is not supported (default RoPE only)")
            thetas.append(float(p.get("rope_theta") or d.get(legacy) or default))
        return thetas[0], thetas[1]
    g = float(d.get("global_rope_theta") or d.get("rope_theta") or 160000.0)
    local = d.get("local_rope_theta", 10000.0)
    return g, float(g if local is None else local)  # 4.x: local None -> global theta


# ---- params -----------------------------------------------------------------------------------


@pytree_dataclass
class Embeddings:  # HF: model.embeddings.*
    tok_embeddings: Embedding  # (V, D)
    norm: Norm


@pytree_dataclass
class Attn:  # HF: model.layers.{i}.attn.*
    wqkv: Linear  # (3*H*K, D): rows q | k | v, heads contiguous
    wo: Linear  # (D, H*K)


@pytree_dataclass
class Mlp:  # HF: model.layers.{i}.mlp.*
    wi: Linear  # (2*F, D): rows input | gate
    wo: Linear  # (D, F)


@pytree_dataclass
class Layer:  # HF: model.layers.{i}.*
    attn_norm: Norm | None  # None in layer 0 (HF has nn.Identity there)
    attn: Attn
    mlp_norm: Norm
    mlp: Mlp


@pytree_dataclass
class PredictionHead:  # HF: head.*  (dense -> act -> norm)
    dense: Linear
    norm: Norm


@pytree_dataclass
class ModernBertParams:
    embeddings: Embeddings
    layers: tuple[Layer, ...]
    final_norm: Norm
    head: PredictionHead | None = None  # MLM / classification checkpoints
    decoder: Linear | None = None  # MLM: weight None-tied to tok_embeddings unless untied
    classifier: Linear | None = None  # sequence classification: (num_labels, D)
    config: ModernBertConfig = static(None)


def params_spec(cfg: ModernBertConfig, *, heads: tuple[str, ...] = ()) -> ModernBertParams:
    """The params tree with `ParamSpec` leaves. `heads` adds "mlm" and/or "classifier" pieces."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size

    def lin(o: int, i: int, bias: bool) -> Linear:
        return Linear(ParamSpec((o, i)), ParamSpec((o,), "zeros") if bias else None)

    def norm() -> Norm:
        return Norm(ParamSpec((D,), "ones"), ParamSpec((D,), "zeros") if cfg.norm_bias else None)

    layers = tuple(
        Layer(
            attn_norm=None if i == 0 else norm(),
            attn=Attn(wqkv=lin(3 * D, D, cfg.attention_bias), wo=lin(D, D, cfg.attention_bias)),
            mlp_norm=norm(),
            mlp=Mlp(wi=lin(2 * F, D, cfg.mlp_bias), wo=lin(D, F, cfg.mlp_bias)),
        )
        for i in range(cfg.num_hidden_layers)
    )
    head = PredictionHead(lin(D, D, cfg.classifier_bias), norm()) if heads else None
    decoder = None
    if "mlm" in heads:
        weight = None if cfg.tie_word_embeddings else ParamSpec((V, D))
        decoder = Linear(weight, ParamSpec((V,), "zeros") if cfg.decoder_bias else None)
    classifier = lin(cfg.num_labels or 2, D, True) if "classifier" in heads else None
    return ModernBertParams(
        embeddings=Embeddings(Embedding(ParamSpec((V, D))), norm()),
        layers=layers,
        final_norm=norm(),
        head=head,
        decoder=decoder,
        classifier=classifier,
        config=cfg,
    )


# ---- forward ----------------------------------------------------------------------------------
#
# The residual stream is carried as (delta, residual): each block returns its output `delta`
# un-added, and the next norm adds it with `ops.add_layer_norm`, which rounds the sum to the
# activation dtype before the statistics (exactly HF's `x = x + f(x)` then `norm(x)`) and returns
# that rounded sum as the new residual. One fused kernel then replaces an add and a norm.
#
# Inference without dropout folds the add into the output projection instead (`ops.linear_add`:
# cuBLAS adds the residual in the GEMM's epilogue, in place: the stream is this encode's own buffer
# from the embedding norm on) and the next norm is a plain LayerNorm: a GEMM that reads the
# residual once more, and a norm that moves half the bytes
# (benchmarks/results/history/residual_probe_h200_e7fd728.txt). The sum then rounds once where HF
# rounds the projection, then the sum. Training keeps the carry: there the residual would feed both
# the GEMM and the norm, and autograd would add their gradients in a separate kernel, where
# add_layer_norm's backward sums them in its own.


def _norm(norm: Norm, delta_TD: Tensor | None, residual_TD: Tensor, eps: float, ops: Ops) -> tuple[Tensor, Tensor]:
    """(normalised rows, residual stream) with the pending delta (if any) added first."""
    if delta_TD is None:
        return ops.layer_norm(residual_TD, norm.weight, norm.bias, eps), residual_TD
    return ops.add_layer_norm(delta_TD, residual_TD, norm.weight, norm.bias, eps, overwrite_input=True)


def _project(x_TX: Tensor, lin: Linear, residual_TD: Tensor, fold: bool, ops: Ops) -> tuple[Tensor | None, Tensor]:
    """A block's output projection as (delta, residual): added now when `fold`, else left pending."""
    if fold:
        return None, ops.linear_add(x_TX, lin.weight, lin.bias, residual_TD, overwrite_input=True)
    return ops.linear(x_TX, lin.weight, lin.bias), residual_TD


def layer(p: Layer, delta_TD: Tensor | None, residual_TD: Tensor, cu_seqlens: Tensor, max_seqlen: int,
          positions_T: Tensor, i: int, cfg: ModernBertConfig, ops: Ops,
          seed: int | None = None) -> tuple[Tensor | None, Tensor]:
    """One pre-norm ModernBERT layer. Returns (mlp output not yet added or None, residual stream).
    Consumes delta_TD and residual_TD: eager inference writes the norms' outputs into them."""
    T, H, K = residual_TD.shape[0], cfg.num_attention_heads, cfg.head_dim
    eps = cfg.norm_eps
    is_global = cfg.is_global_layer(i)
    window = (-1, -1) if is_global else (cfg.local_attention // 2,) * 2  # local: |q-k| <= 64
    theta = cfg.global_rope_theta if is_global else cfg.local_rope_theta
    fold = seed is None and not torch.is_grad_enabled()  # inference: see above

    wqkv = p.attn.wqkv
    if p.attn_norm is None:  # layer 0: the embedding norm already normalised (HF: nn.Identity)
        qkv_TN = ops.linear(residual_TD, wqkv.weight, wqkv.bias)
    elif delta_TD is None:  # the add is done (inference): the norm is the GEMM's, where the table fuses them
        qkv_TN = ops.layer_norm_linear(residual_TD, p.attn_norm.weight, p.attn_norm.bias, eps, wqkv.weight, wqkv.bias)
    else:
        h_TD, residual_TD = _norm(p.attn_norm, delta_TD, residual_TD, eps, ops)
        qkv_TN = ops.linear(h_TD, wqkv.weight, wqkv.bias)
    qkv_T3HK = qkv_TN.view(T, 3, H, K)
    # RoPE (positions restart per sequence), then attention: one kernel where the table fuses
    # them, else rotary and varlen_attention. qkv is this layer's own temporary: kernels may
    # overwrite it in inference.
    attn_drop = attention_dropout(cfg.attention_dropout, "attention_dropout", ops, seed, i)
    o_THK = ops.rotary_attention(qkv_T3HK, positions_T, theta, cu_seqlens, max_seqlen, window=window,
                                 overwrite_input=True, **attn_drop)
    a_TD, residual_TD = _project(o_THK.reshape(T, H * K), p.attn.wo, residual_TD, fold, ops)
    if a_TD is not None:
        a_TD = dropout(a_TD, cfg.attention_dropout, seed, i, 1)

    # Wi's (2F, D) rows are the input half then the gate half: act(h Wi_in^T) * (h Wi_gate^T)
    if a_TD is None:  # the add is done (inference): the norm is the GEMM's, where the table fuses them
        g_TF = ops.layer_norm_linear_glu(residual_TD, p.mlp_norm.weight, p.mlp_norm.bias, eps, p.mlp.wi.weight,
                                         p.mlp.wi.bias, cfg.hidden_activation)
    else:  # a_TD and the old residual are dead after the add: the norm may write into them
        h_TD, residual_TD = _norm(p.mlp_norm, a_TD, residual_TD, eps, ops)
        g_TF = ops.linear_glu(h_TD, p.mlp.wi.weight, p.mlp.wi.bias, cfg.hidden_activation)
    g_TF = dropout(g_TF, cfg.mlp_dropout, seed, i, 2)
    return _project(g_TF, p.mlp.wo, residual_TD, fold, ops)


def encode(
    params: ModernBertParams,
    ids: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int | None = None,
    positions: Tensor | None = None,
    *,
    backend: str | Ops = "auto",
    validate: bool = False,
    compute_dtype: torch.dtype | None = None,
    dropout_seed: int | None = None,
    checkpoint: bool = False,
) -> Tensor:
    """Last hidden state of every packed token (after `final_norm`).

    Arguments:
        params: a `ModernBertParams` tree (from `packedenc.load` or `init`).
        ids: (T,) integer token ids, sequences back to back, no padding.
        cu_seqlens: (S+1,) int32 boundaries, starting at 0 and ending at T.
        max_seqlen: host int, the longest sequence; computed (one host sync) when None.
        positions: (T,) position inside each sequence; derived from cu_seqlens when None.
        backend: "auto", "reference", "triton", "flash", or an `Ops` table.
        validate: check values of ids / cu_seqlens even when they live on a GPU (syncs).
        compute_dtype: run in this dtype (e.g. bf16) while params stay in theirs (e.g. fp32 master
            weights); gradients flow back to the original leaves.
        dropout_seed: None = no dropout (inference). An int turns on the config's embedding /
            attention / MLP dropout with masks derived from (seed, layer, site): a step is
            reproducible, and recomputation under `checkpoint` draws the same masks.
        checkpoint: recompute each layer in the backward pass instead of keeping its activations
            (torch.autograd only: torch.func does not support checkpoint's saved-tensor hooks).
    Return:
        (T, D) in the compute dtype.
    """
    cfg = params.config
    ids, cu_seqlens, max_seqlen, positions = prepare_inputs(
        ids, cu_seqlens, max_seqlen, positions, cfg.vocab_size, validate, compute_dtype=compute_dtype
    )
    if compute_dtype is not None:
        params = tree_cast(params, compute_dtype)
    ops = get_ops(backend, ids.device)
    emb, norm = params.embeddings, params.embeddings.norm
    x_TD = ops.embed_layer_norm(ids, emb.tok_embeddings.weight, norm.weight, norm.bias, cfg.norm_eps)
    delta_TD, residual_TD = None, dropout(x_TD, cfg.embedding_dropout, dropout_seed, -1, 0)
    for i, p in enumerate(params.layers):
        args = (p, delta_TD, residual_TD, cu_seqlens, max_seqlen, positions, i, cfg, ops, dropout_seed)
        if checkpoint and torch.is_grad_enabled():
            delta_TD, residual_TD = torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False)
        else:
            delta_TD, residual_TD = layer(*args)
    return _norm(params.final_norm, delta_TD, residual_TD, cfg.norm_eps, ops)[0]


# ---- heads (pure functions of the same params) -------------------------------------------------


def _head(params: ModernBertParams, h_XD: Tensor, ops: Ops) -> Tensor:
    if params.head is None:
        raise ConfigError("these params have no prediction head: load an MLM or classification checkpoint")
    cfg = params.config
    d, n = params.head.dense, params.head.norm
    a_XD = ops.activation(ops.linear(h_XD, d.weight, d.bias), cfg.classifier_activation)
    return ops.layer_norm(a_XD, n.weight, n.bias, cfg.norm_eps)


def mlm_head(params: ModernBertParams, hidden_TD: Tensor, *,
             backend: str | Ops = "auto") -> tuple[Tensor, Tensor, Tensor | None]:
    """(T, D) hidden -> (features (T, D), decoder weight (V, D), decoder bias (V,) or None).

    The MLM logits are `linear(features, weight, bias)` (`mlm_logits`); `losses.mlm_loss` hands
    these three to `ops.linear_cross_entropy`, which never keeps the (T, V) logits.
    """
    if params.decoder is None:
        raise ConfigError("these params have no MLM decoder: load a ModernBertForMaskedLM checkpoint")
    ops = get_ops(backend, hidden_TD.device)
    w = params.decoder.weight
    w = params.embeddings.tok_embeddings.weight if w is None else w  # tied
    return _head(params, hidden_TD, ops), w, params.decoder.bias


def mlm_logits(params: ModernBertParams, hidden_TD: Tensor, *, backend: str | Ops = "auto") -> Tensor:
    """(T, D) hidden -> (T, V) MLM logits: head (dense, act, norm), then the (tied) decoder.

    To score only some tokens (masked positions), index `hidden_TD` before calling.
    """
    ops = get_ops(backend, hidden_TD.device)
    return ops.linear(*mlm_head(params, hidden_TD, backend=ops))


def classify(params: ModernBertParams, hidden_TD: Tensor, cu_seqlens: Tensor, *,
             backend: str | Ops = "auto") -> Tensor:
    """(T, D) hidden -> (S, num_labels) logits: cls/mean pooling -> head -> classifier."""
    if params.classifier is None:
        raise ConfigError("these params have no classifier: load a ...ForSequenceClassification checkpoint")
    ops = get_ops(backend, hidden_TD.device)
    pooled_SD = (pool_first if params.config.classifier_pooling == "cls" else pool_mean)(hidden_TD, cu_seqlens)
    c = params.classifier
    return ops.linear(_head(params, pooled_SD, ops), c.weight, c.bias)


def init(cfg: ModernBertConfig, generator: torch.Generator | None = None, *,
         heads: tuple[str, ...] = (), dtype: torch.dtype = torch.float32) -> ModernBertParams:
    """Random params (normal(0, initializer_range) weights, unit norms, zero biases)."""
    from packedenc.models.common import init_from_spec

    return init_from_spec(params_spec(cfg, heads=heads), cfg.initializer_range, generator, dtype)


def config_from_hf(d: dict[str, Any]) -> ModernBertConfig:
    return ModernBertConfig.from_hf(d)
