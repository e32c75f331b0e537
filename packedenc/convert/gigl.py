"""GiGL `GraphTransformerEncoder` checkpoints <-> graph-transformer params trees.

GiGL checkpoints are `torch.save(model.state_dict())` files (`gigl...utils.model.save_state_dict`),
written from a `LinkPredictionGNN` (keys under `_encoder.`), often unwrapped from DDP (`module.`);
both prefixes are stripped. The state_dict does not say everything (heads, activation, readout,
attribute-name lists), so the encoder's constructor arguments come along:

    params = from_gigl(torch.load(path, weights_only=True), gigl_kwargs)   # kwargs as given to GiGL
    sd, kwargs = to_gigl(params)            # GraphTransformerEncoder(**kwargs).load_state_dict(sd)

GiGL features the packed encoder does not implement are refused with a ConfigError (in the
kwargs) or a CheckpointError (in the weights): node-level PE (`pe_attr_names`), continuous token
inputs, sinusoidal sequence PE, pairwise attention bias, relation-aware attention / messages,
feature-embedding layers. Dropout rates are accepted and ignored (encode is eval-mode math).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch
from torch import Tensor

from packedenc.errors import CheckpointError, ConfigError
from packedenc.models.graph_transformer import GraphTransformerConfig, params_spec
from packedenc.models.graph_transformer.params import HOP_EMBEDDING
from packedenc.pytree import ParamSpec, named_leaves, tree_map_specs

__all__ = ["from_gigl", "to_gigl", "config_from_gigl", "gigl_kwargs", "strip_prefixes", "gigl_key"]

PREFIXES = ("module.", "_encoder.")

# kwargs -> value meaning "off"; anything else is a feature the packed encoder lacks
_UNSUPPORTED_KWARGS = {
    "pe_attr_names": (None, [], ()),
    "pairwise_attention_bias_attr_names": (None, [], ()),
    "feature_embedding_layer_dict": (None,),
    "sequence_positional_encoding_type": (None, "none", "None"),
    "relation_attention_mode": ("none",),
    "relation_message_mode": ("none",),
}
# state_dict key prefixes of those features (after prefix stripping)
_UNSUPPORTED_KEYS = {
    "_concat_pe_fusion_projection": "node-level PE (pe_attr_names, concat mode)",
    "_pe_projection": "node-level PE (pe_attr_names, add mode)",
    "_token_input_projection": "continuous token inputs (anchor_based_input_attr_names)",
    "_pairwise_pe_attention_bias_projection": "pairwise attention bias",
    "_pairwise_nonmissing_attention_bias": "pairwise attention bias",
    "_feature_embedding_layer_dict": "feature_embedding_layer_dict",
}
_UNSUPPORTED_LAYER_KEY = re.compile(r"_encoder_layers\.\d+\._relation_")
# kwargs that change only data loading / training, copied into the config or ignored
_PIPELINE_KWARGS = ("max_seq_len", "hop_distance", "sequence_construction_method", "sampling_direction")
_IGNORED_KWARGS = ("dropout_rate", "attention_dropout_rate", "pe_integration_mode")


def strip_prefixes(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Drop leading `module.` (DDP) and `_encoder.` (LinkPredictionGNN) prefixes, in any nesting.

    A LinkPredictionGNN checkpoint also holds its decoder; keys outside `_encoder.` are dropped
    when any key has that prefix.
    """
    def strip(k: str) -> tuple[str, bool]:
        enc = False
        while True:
            for p in PREFIXES:
                if k.startswith(p):
                    enc |= p == "_encoder."
                    k = k[len(p):]
                    break
            else:
                return k, enc

    stripped = {k: strip(k) for k in state_dict}
    has_encoder = any(enc for _, enc in stripped.values())
    out: dict[str, Tensor] = {}
    for k, (name, enc) in stripped.items():
        if has_encoder and not enc:
            continue
        if name in out:
            raise CheckpointError(f"two checkpoint keys map to {name!r} after stripping {PREFIXES}")
        out[name] = state_dict[k]
    return out


def gigl_key(path: str, cfg: GraphTransformerConfig) -> str:
    """GiGL state_dict key of a params leaf path ("encoder_layers.0.ffn.linear_in.weight" ->
    "_encoder_layers.0._ffn._ffn.0.weight")."""
    parts = path.split(".")
    if parts[0] == "encoder_layers" and parts[2] == "ffn":
        lin = parts[3]
        if cfg.is_xglu:
            tail = [f"_{lin}"]
        else:
            tail = ["_ffn", "0" if lin == "linear_in" else "3"]
        return ".".join(["_encoder_layers", parts[1], "_ffn", *tail, parts[4]])
    if parts[0] == "encoder_layers":
        return ".".join(["_encoder_layers", parts[1], f"_{parts[2]}", *parts[3:]])
    return ".".join([f"_{parts[0]}", *parts[1:]])  # dict keys (node types) keep their names


def _embedding_rows(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, torch.nn.Embedding):
        return value.num_embeddings
    raise ConfigError(f"anchor_based_input_embedding_dict['{HOP_EMBEDDING}'] must be an nn.Embedding or "
                      f"a row count, got {type(value).__name__}")


def config_from_gigl(kwargs: Mapping[str, Any], state_dict: Mapping[str, Tensor] | None = None
                     ) -> GraphTransformerConfig:
    """Config from GiGL `GraphTransformerEncoder` constructor kwargs (plus the stripped state_dict,
    which supplies the hop-embedding row count when the kwargs do not)."""
    kw = dict(kwargs)
    for name, off in _UNSUPPORTED_KWARGS.items():
        v = kw.get(name, off[0])
        if not any(v is o or v == o for o in off):
            raise ConfigError(f"GiGL option {name}={v!r} is not supported by the packed graph transformer "
                              f"(supported: {off[0]!r}); convert a model trained without it")
    for name in ("node_type_to_feat_dim_map", "hid_dim"):
        if name not in kw:
            raise ConfigError(f"GiGL kwargs lack {name!r}, which GraphTransformerEncoder requires")
    emb = dict(kw.get("anchor_based_input_embedding_dict") or {})
    inputs = list(kw.get("anchor_based_input_attr_names") or ())
    if set(emb) - {HOP_EMBEDDING}:
        raise ConfigError(f"only a {HOP_EMBEDDING!r} token embedding is supported, got {sorted(emb)}")
    continuous = [a for a in inputs if a not in emb]
    if continuous:
        raise ConfigError(f"continuous token inputs {continuous} are not supported (only the embedded "
                          f"{HOP_EMBEDDING!r}); convert a model trained without them")
    if emb and HOP_EMBEDDING not in inputs:
        raise ConfigError(f"anchor_based_input_embedding_dict has {HOP_EMBEDDING!r} but "
                          "anchor_based_input_attr_names does not list it (GiGL rejects this too)")
    rows = _embedding_rows(emb.get(HOP_EMBEDDING))
    key = f"_anchor_based_input_embedding_dict.{HOP_EMBEDDING}.weight"
    if emb and state_dict is not None and key in state_dict:
        sd_rows = state_dict[key].shape[0]
        if rows is not None and rows != sd_rows:
            raise CheckpointError(f"{key} has {sd_rows} rows but the kwargs' embedding has {rows}")
        rows = sd_rows
    if emb and rows is None:
        raise ConfigError(f"give the {HOP_EMBEDDING!r} embedding as nn.Embedding(V, hid_dim) or pass the state_dict")
    names = ("out_dim", "num_layers", "num_heads", "activation", "feedforward_ratio", "readout_mode",
             "should_l2_normalize_embedding_layer_output", "edge_type_to_feat_dim_map", *_PIPELINE_KWARGS)
    return GraphTransformerConfig(
        node_type_to_feat_dim_map=kw["node_type_to_feat_dim_map"],
        hid_dim=kw["hid_dim"],
        hop_distance_embedding_size=rows or 0,
        anchor_based_attention_bias_attr_names=tuple(kw.get("anchor_based_attention_bias_attr_names") or ()),
        **{n: kw[n] for n in names if n in kw and kw[n] is not None},
    )


def from_gigl(state_dict: Mapping[str, Tensor], kwargs: Mapping[str, Any] | GraphTransformerConfig, *,
              dtype: torch.dtype | None = None) -> Any:
    """Params tree from a GiGL state_dict (prefixes stripped) and constructor kwargs (or a config).

    Every leaf is read exactly once; a missing, unexpected, mis-shaped or uninitialised (LazyLinear
    before its first forward) tensor raises a CheckpointError naming the key.
    """
    sd = strip_prefixes(state_dict)
    cfg = kwargs if isinstance(kwargs, GraphTransformerConfig) else config_from_gigl(kwargs, sd)
    for k in sd:
        hit = next((why for p, why in _UNSUPPORTED_KEYS.items() if k == p or k.startswith(p + ".")), None)
        if hit is None and _UNSUPPORTED_LAYER_KEY.match(k):
            hit = "relation-aware attention / messages"
        if hit is not None:
            raise CheckpointError(f"checkpoint key {k!r} belongs to {hit}, which the packed graph "
                                  "transformer does not implement")
    spec = params_spec(cfg)
    wanted = {path: gigl_key(path, cfg) for path, _ in named_leaves(spec)}
    missing = sorted(k for k in wanted.values() if k not in sd)
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {missing[:8]} (do the kwargs "
                              "match the trained model? num_layers, activation, readout_mode, attr names)")
    unexpected = sorted(set(sd) - set(wanted.values()))
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} unexpected tensor(s): {unexpected[:8]} "
                              "(do the kwargs match the trained model?)")

    def build(path: str, s: ParamSpec) -> Tensor:
        key = wanted[path]
        t = sd[key]
        if isinstance(t, torch.nn.parameter.UninitializedParameter):
            raise CheckpointError(f"{key!r} is an uninitialised LazyLinear weight: run one forward before "
                                  "saving the GiGL model")
        if tuple(t.shape) != tuple(s.shape):
            raise CheckpointError(f"{key!r} has shape {tuple(t.shape)} but the kwargs imply {tuple(s.shape)}")
        t = t.detach()
        return t if dtype is None else t.to(dtype)

    return tree_map_specs(build, spec)


def gigl_kwargs(cfg: GraphTransformerConfig) -> dict[str, Any]:
    """GraphTransformerEncoder constructor kwargs for a config (the inverse of config_from_gigl)."""
    kw: dict[str, Any] = {
        "node_type_to_feat_dim_map": dict(cfg.node_type_to_feat_dim_map),
        "edge_type_to_feat_dim_map": dict(cfg.edge_type_to_feat_dim_map),
        "hid_dim": cfg.hid_dim,
        "out_dim": cfg.out_dim,
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads,
        "activation": cfg.activation,
        "feedforward_ratio": cfg.feedforward_ratio,
        "readout_mode": cfg.readout_mode,
        "should_l2_normalize_embedding_layer_output": cfg.should_l2_normalize_embedding_layer_output,
        "anchor_based_attention_bias_attr_names": list(cfg.anchor_based_attention_bias_attr_names) or None,
        **{n: getattr(cfg, n) for n in _PIPELINE_KWARGS},
    }
    if cfg.hop_distance_embedding_size:
        kw["anchor_based_input_attr_names"] = [HOP_EMBEDDING]
        kw["anchor_based_input_embedding_dict"] = torch.nn.ModuleDict(
            {HOP_EMBEDDING: torch.nn.Embedding(cfg.hop_distance_embedding_size, cfg.hid_dim)}
        )
    return kw


def to_gigl(params: Any, *, prefix: str = "") -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(GiGL state_dict, constructor kwargs) for a graph-transformer params tree.

    `prefix="_encoder."` gives the keys a LinkPredictionGNN holds. Tensors are shared, not copied.
    """
    cfg = params.config
    sd = {prefix + gigl_key(path, cfg): t for path, t in named_leaves(params)}
    return sd, gigl_kwargs(cfg)
