"""Params tree of the graph transformer, named after GiGL's submodules (leading `_` dropped).

    GiGL state_dict key                                   params leaf
    _node_projection_dict.{type}.weight / .bias           node_projection_dict[type].weight / .bias
    _anchor_based_input_embedding_dict.hop_distance.weight  anchor_based_input_embedding_dict["hop_distance"].weight
    _anchor_pe_attention_bias_projection.weight           anchor_pe_attention_bias_projection.weight
    _encoder_layers.{i}._{attention,ffn}_norm.*           encoder_layers[i].{attention,ffn}_norm.*
    _encoder_layers.{i}._{query,key,value,output}_projection.*  encoder_layers[i].{...}_projection.*
    _encoder_layers.{i}._ffn._ffn.0.* / ._ffn._ffn.3.*    encoder_layers[i].ffn.linear_in / linear_out
    _encoder_layers.{i}._ffn._linear_in.* / _linear_out.* (gated FFNs: same leaves)
    _final_norm.*, _readout_attention.*, _output_projection.*

Linear weights keep torch's (out, in) layout. Shapes: D hid_dim, F ffn width, H heads, A key-bias
features, V hop-embedding rows, O out_dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from packedenc.models.graph_transformer.config import GraphTransformerConfig
from packedenc.pytree import Embedding, Linear, Norm, ParamSpec, pytree_dataclass, static, tree_map_specs

__all__ = ["FeedForward", "EncoderLayer", "GraphTransformerParams", "params_spec", "init"]

HOP_EMBEDDING = "hop_distance"  # the one embedded token input the packed encoder takes (`hops=`)


@pytree_dataclass
class FeedForward:  # GiGL: _encoder_layers.{i}._ffn.*
    linear_in: Linear  # (F, D); gated FFNs (2F, D) with the gate (activated) half first
    linear_out: Linear  # (D, F)


@pytree_dataclass
class EncoderLayer:  # GiGL: _encoder_layers.{i}.*  (pre-norm)
    attention_norm: Norm
    query_projection: Linear  # (D, D), heads contiguous
    key_projection: Linear
    value_projection: Linear
    output_projection: Linear
    ffn_norm: Norm
    ffn: FeedForward


@pytree_dataclass
class GraphTransformerParams:
    node_projection_dict: dict[str, Linear]  # per node type, config order: (D, F_t)
    encoder_layers: tuple[EncoderLayer, ...]
    final_norm: Norm
    output_projection: Linear  # (O, D)
    anchor_based_input_embedding_dict: dict[str, Embedding] | None = None  # {"hop_distance": (V, D)}
    anchor_pe_attention_bias_projection: Linear | None = None  # (H, A), no bias
    readout_attention: Linear | None = None  # (1, 2D): [:, :D] scores the anchor, [:, D:] the neighbour
    config: GraphTransformerConfig = static(None)


def params_spec(cfg: GraphTransformerConfig, *, heads: tuple[str, ...] = ()) -> GraphTransformerParams:
    """The params tree with `ParamSpec` leaves (`heads` is accepted for the family interface; unused).

    `init` strings: "xavier" (GiGL's init of Q/K/V/O and FFN weights), "fan_in" (nn.Linear's
    default bound 1/sqrt(fan_in)), "normal" (nn.Embedding: N(0, 1)), "ones", "zeros".
    """
    D, F, H = cfg.hid_dim, cfg.ffn_dim, cfg.num_heads

    def lin(o: int, i: int, init: str = "xavier", bias: bool = True) -> Linear:
        return Linear(ParamSpec((o, i), init), ParamSpec((o,), "zeros") if bias else None)

    def norm() -> Norm:
        return Norm(ParamSpec((D,), "ones"), ParamSpec((D,), "zeros"))

    layers = tuple(
        EncoderLayer(
            attention_norm=norm(),
            query_projection=lin(D, D),
            key_projection=lin(D, D),
            value_projection=lin(D, D),
            output_projection=lin(D, D),
            ffn_norm=norm(),
            ffn=FeedForward(lin(2 * F if cfg.is_xglu else F, D), lin(D, F)),
        )
        for _ in range(cfg.num_layers)
    )
    emb = None
    if cfg.hop_distance_embedding_size:
        emb = {HOP_EMBEDDING: Embedding(ParamSpec((cfg.hop_distance_embedding_size, D), "normal"))}
    bias_proj = lin(H, cfg.key_bias_dim, "fan_in", bias=False) if cfg.key_bias_dim else None
    readout = lin(1, 2 * D, "fan_in") if cfg.readout_mode == "anchor_neighbor_attention" else None
    return GraphTransformerParams(
        node_projection_dict={t: lin(D, f, "fan_in") for t, f in cfg.node_type_to_feat_dim_map},
        encoder_layers=layers,
        final_norm=norm(),
        output_projection=lin(cfg.out_dim, D, "fan_in"),
        anchor_based_input_embedding_dict=emb,
        anchor_pe_attention_bias_projection=bias_proj,
        readout_attention=readout,
        config=cfg,
    )


def init(cfg: GraphTransformerConfig, generator: torch.Generator | None = None, *,
         heads: tuple[str, ...] = (), dtype: torch.dtype = torch.float32) -> GraphTransformerParams:
    """Random params as GiGL initialises them (xavier-uniform layers, zero biases, unit norms)."""

    def make(_: str, s: ParamSpec) -> Tensor:
        if s.init == "zeros":
            return torch.zeros(s.shape, dtype=dtype)
        if s.init == "ones":
            return torch.ones(s.shape, dtype=dtype)
        if s.init == "normal":
            return torch.randn(s.shape, generator=generator).to(dtype)
        fan_out, fan_in = s.shape
        bound = math.sqrt(6.0 / (fan_in + fan_out)) if s.init == "xavier" else 1.0 / math.sqrt(max(fan_in, 1))
        return ((torch.rand(s.shape, generator=generator) * 2 - 1) * bound).to(dtype)

    return tree_map_specs(make, params_spec(cfg, heads=heads))
