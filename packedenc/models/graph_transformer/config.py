"""Config of GiGL's `GraphTransformerEncoder` (Snapchat/GiGL `gigl/nn/graph_transformer.py`, v0.3.1).

Field names are GiGL's constructor arguments, so a GiGL YAML/kwargs dict maps over one to one
(`packedenc.convert.gigl.config_from_gigl`). The features GiGL offers that the packed encoder does
not implement (node-level PE fusion, continuous token inputs, sinusoidal sequence PE, pairwise
biases, relation-aware attention / messages) have no field here and are rejected at conversion.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from packedenc.errors import ConfigError

__all__ = ["GraphTransformerConfig", "MODEL_TYPE", "ACTIVATIONS", "XGLU"]

MODEL_TYPE = "graph_transformer"
READOUTS = ("anchor_neighbor_attention", "anchor_only")
STANDARD_ACTS = ("gelu", "relu", "silu", "tanh")  # FFN: Linear -> act -> Linear
XGLU = {"geglu": "gelu", "swiglu": "silu", "reglu": "relu"}  # act(first half) * second half
ACTIVATIONS = STANDARD_ACTS + tuple(XGLU)


def _pairs(value: Any, what: str) -> tuple[tuple[Any, int], ...]:
    """A mapping (or pairs) -> a hashable tuple of (key, int) pairs, in the given order."""
    items = value.items() if isinstance(value, Mapping) else value
    out = []
    for k, v in items:
        k = tuple(k) if isinstance(k, list) else k  # edge types come back from JSON as lists
        out.append((k if isinstance(k, tuple) else str(k), int(v)))
    if len({k for k, _ in out}) != len(out):
        raise ConfigError(f"{what} names a key twice: {[k for k, _ in out]}")
    return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphTransformerConfig:
    """Static config of a packed graph transformer (hashable; rides in the params pytree).

    Fields (GiGL constructor names):
        node_type_to_feat_dim_map: ordered (node type, input feature dim) pairs (a dict is accepted).
            `encode(..., node_types=)` indexes this order.
        hid_dim, out_dim, num_layers, num_heads: width, output width, depth, heads (hid_dim % heads == 0).
        activation: FFN kind, "gelu" | "relu" | "silu" | "tanh" (Linear, act, Linear) or the gated
            "geglu" | "swiglu" | "reglu" (act(first half) * second half).
        feedforward_ratio: FFN width = int(hid_dim * ratio); None = 4.0, or 8/3 for gated FFNs.
        readout_mode: "anchor_neighbor_attention" (anchor + attention-weighted neighbours, GiGL's
            default) or "anchor_only" (the anchor's final state; the last layer then computes only
            the anchor queries).
        should_l2_normalize_embedding_layer_output: L2-normalise the output embeddings.
        hop_distance_embedding_size: rows of the hop-distance embedding added to every token
            (GiGL `anchor_based_input_embedding_dict={"hop_distance": nn.Embedding(V, hid_dim)}`);
            0 means no embedding.
        anchor_based_attention_bias_attr_names: names of the anchor-relative token features whose
            projection `Linear(A, num_heads, bias=False)` is added to every query's score of that key.
        norm_eps: LayerNorm eps (GiGL uses nn.LayerNorm's default, 1e-5).
        edge_type_to_feat_dim_map, max_seq_len, hop_distance, sequence_construction_method,
        sampling_direction: data-pipeline arguments that do not change the encoder math; kept so
            GiGL kwargs round-trip and as defaults for `khop_sequences`.
    """

    node_type_to_feat_dim_map: tuple[tuple[str, int], ...]
    hid_dim: int
    out_dim: int = 128
    num_layers: int = 2
    num_heads: int = 2
    activation: str = "gelu"
    feedforward_ratio: float | None = None
    readout_mode: str = "anchor_neighbor_attention"
    should_l2_normalize_embedding_layer_output: bool = False
    hop_distance_embedding_size: int = 0
    anchor_based_attention_bias_attr_names: tuple[str, ...] = ()
    norm_eps: float = 1e-5
    edge_type_to_feat_dim_map: tuple[tuple[Any, int], ...] = ()
    max_seq_len: int = 128
    hop_distance: int = 2
    sequence_construction_method: str = "khop"
    sampling_direction: str = "out"

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("node_type_to_feat_dim_map", _pairs(self.node_type_to_feat_dim_map, "node_type_to_feat_dim_map"))
        set_("edge_type_to_feat_dim_map", _pairs(self.edge_type_to_feat_dim_map, "edge_type_to_feat_dim_map"))
        set_("anchor_based_attention_bias_attr_names", tuple(self.anchor_based_attention_bias_attr_names))
        set_("activation", str(self.activation).lower())
        if not self.node_type_to_feat_dim_map:
            raise ConfigError("node_type_to_feat_dim_map is empty: give at least one (node type, feature dim)")
        bad = [(t, d) for t, d in self.node_type_to_feat_dim_map if d <= 0]
        if bad:
            raise ConfigError(f"node feature dims must be positive, got {bad}")
        for name in ("hid_dim", "out_dim", "num_heads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_layers < 0:
            raise ConfigError(f"num_layers must be >= 0, got {self.num_layers}")
        if self.hid_dim % self.num_heads:
            raise ConfigError(f"hid_dim {self.hid_dim} is not divisible by num_heads {self.num_heads}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation {self.activation!r} is not supported; choose one of {ACTIVATIONS}")
        if self.readout_mode not in READOUTS:
            raise ConfigError(f"readout_mode {self.readout_mode!r} is not supported; choose one of {READOUTS}")
        if self.feedforward_ratio is not None and self.ffn_dim <= 0:
            raise ConfigError(f"feedforward_ratio {self.feedforward_ratio} gives an empty FFN")
        if self.hop_distance_embedding_size < 0:
            raise ConfigError("hop_distance_embedding_size must be >= 0 (0 = no hop embedding)")
        if self.sampling_direction not in ("in", "out"):
            raise ConfigError(f"sampling_direction must be 'in' or 'out', got {self.sampling_direction!r}")
        if self.sequence_construction_method not in ("khop", "ppr"):
            raise ConfigError(
                f"sequence_construction_method must be 'khop' or 'ppr', got {self.sequence_construction_method!r}"
            )

    # ---- derived -------------------------------------------------------------------------------

    @property
    def head_dim(self) -> int:
        return self.hid_dim // self.num_heads

    @property
    def is_xglu(self) -> bool:
        return self.activation in XGLU

    @property
    def ffn_dim(self) -> int:
        ratio = self.feedforward_ratio
        if ratio is None:
            ratio = 8.0 / 3.0 if self.is_xglu else 4.0
        return int(self.hid_dim * ratio)

    @property
    def node_types(self) -> tuple[str, ...]:
        return tuple(t for t, _ in self.node_type_to_feat_dim_map)

    @property
    def feat_dims(self) -> tuple[int, ...]:
        return tuple(d for _, d in self.node_type_to_feat_dim_map)

    @property
    def key_bias_dim(self) -> int:
        return len(self.anchor_based_attention_bias_attr_names)

    # ---- dict form (JSON-able; `model_type` lets packedenc.init dispatch) ----------------------

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["node_type_to_feat_dim_map"] = {t: n for t, n in self.node_type_to_feat_dim_map}
        d["edge_type_to_feat_dim_map"] = [[list(k) if isinstance(k, tuple) else k, n]
                                          for k, n in self.edge_type_to_feat_dim_map]
        d["anchor_based_attention_bias_attr_names"] = list(self.anchor_based_attention_bias_attr_names)
        d["model_type"] = MODEL_TYPE
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GraphTransformerConfig":
        d = dict(d)
        if d.pop("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ConfigError(f"not a graph transformer config: model_type={d.get('model_type')!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown graph transformer config keys {unknown}")
        return cls(**d)

    # The library's generic entry points (packedenc.init) read `to_hf()["model_type"]`; this is
    # the same dict as `to_dict`, not a Hugging Face config.
    to_hf = to_dict
    from_hf = from_dict
