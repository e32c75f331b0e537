"""GiGL GraphTransformerEncoder state_dict + kwargs <-> params: round trips, prefixes, the key map
against a GiGL-layout module, and every refusal."""

from __future__ import annotations

import pytest
import torch

from packedenc.convert.gigl import config_from_gigl, from_gigl, gigl_key, strip_prefixes, to_gigl
from packedenc.errors import CheckpointError, ConfigError
from packedenc.models.graph_transformer import GraphTransformerConfig, encode, init
from packedenc.pytree import named_leaves
from tests.models.graph_padded import PaddedGraphTransformer, padded_inputs

KWARGS = dict(
    node_type_to_feat_dim_map={"user": 6, "item": 4},
    edge_type_to_feat_dim_map={("user", "to", "item"): 0, ("item", "rev_to", "user"): 0},
    hid_dim=16, out_dim=8, num_layers=2, num_heads=4, max_seq_len=64, hop_distance=3,
    activation="GELU", readout_mode="anchor_neighbor_attention", dropout_rate=0.1,
    anchor_based_attention_bias_attr_names=["hop_distance"],
    anchor_based_input_attr_names=["hop_distance"],
    anchor_based_input_embedding_dict=torch.nn.ModuleDict({"hop_distance": torch.nn.Embedding(5, 16)}),
)


def gigl_state_dict(kwargs, seed=0):
    """A state_dict with GiGL's names and random values, made through a GiGL-layout module."""
    torch.manual_seed(seed)
    m = PaddedGraphTransformer(config_from_gigl(kwargs))
    return {k: v.detach() + 0.1 * torch.randn_like(v) for k, v in m.state_dict().items()}


def assert_same_tree(a, b):
    la, lb = dict(named_leaves(a)), dict(named_leaves(b))
    assert la.keys() == lb.keys()
    for k in la:
        assert torch.equal(la[k], lb[k]), k


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("readout", ["anchor_neighbor_attention", "anchor_only"])
def test_round_trip_is_bit_identical(activation, readout):
    kw = dict(KWARGS, activation=activation, readout_mode=readout)
    sd = gigl_state_dict(kw)
    p = from_gigl(sd, kw)
    sd2, kw2 = to_gigl(p)
    assert sd2.keys() == sd.keys() and all(torch.equal(sd2[k], sd[k]) for k in sd)
    p2 = from_gigl(sd2, kw2)
    assert p2.config == p.config
    assert_same_tree(p, p2)
    assert kw2["anchor_based_input_embedding_dict"]["hop_distance"].num_embeddings == 5
    assert kw2["edge_type_to_feat_dim_map"] == KWARGS["edge_type_to_feat_dim_map"]


def test_ddp_and_link_prediction_prefixes_are_stripped():
    sd = gigl_state_dict(KWARGS)
    wrapped = {f"module._encoder.{k}": v for k, v in sd.items()}
    wrapped["module._decoder.weight"] = torch.zeros(3)  # LinkPredictionGNN's decoder: not ours
    assert strip_prefixes(wrapped).keys() == sd.keys()
    assert_same_tree(from_gigl(wrapped, KWARGS), from_gigl(sd, KWARGS))
    sd_enc, _ = to_gigl(from_gigl(sd, KWARGS), prefix="_encoder.")
    assert all(k.startswith("_encoder._") for k in sd_enc)


def test_export_loads_strictly_into_gigl_layout_and_gives_same_embeddings():
    cfg = config_from_gigl(KWARGS)
    p = init(cfg, torch.Generator().manual_seed(1))
    m = PaddedGraphTransformer(cfg)
    m.load_state_dict(to_gigl(p)[0], strict=True)
    g = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 1, 5, 12], dtype=torch.int32)
    x = torch.randn(12, 6, generator=g)
    nt = torch.randint(0, 2, (12,), generator=g)
    hops = torch.tensor([0, 0, 1, 1, 2, 0, 1, 1, 2, 2, 3, 4])
    kf = hops.float()[:, None]
    out = encode(p, x, cu, node_types=nt, hops=hops, key_features=kf, backend="reference")
    with torch.no_grad():
        ref, _ = m(*padded_inputs(x, cu, nt, hops, kf))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_key_map_examples():
    cfg = config_from_gigl(KWARGS)
    glu = config_from_gigl(dict(KWARGS, activation="reglu"))
    assert gigl_key("encoder_layers.1.ffn.linear_in.weight", cfg) == "_encoder_layers.1._ffn._ffn.0.weight"
    assert gigl_key("encoder_layers.1.ffn.linear_out.bias", cfg) == "_encoder_layers.1._ffn._ffn.3.bias"
    assert gigl_key("encoder_layers.0.ffn.linear_in.weight", glu) == "_encoder_layers.0._ffn._linear_in.weight"
    assert gigl_key("encoder_layers.0.query_projection.bias", cfg) == "_encoder_layers.0._query_projection.bias"
    assert gigl_key("node_projection_dict.user.weight", cfg) == "_node_projection_dict.user.weight"
    assert gigl_key("readout_attention.weight", cfg) == "_readout_attention.weight"


def test_config_from_kwargs():
    cfg = config_from_gigl(KWARGS)
    assert cfg.activation == "gelu" and cfg.hop_distance_embedding_size == 5 and cfg.key_bias_dim == 1
    assert cfg.node_types == ("user", "item") and cfg.max_seq_len == 64 and cfg.hop_distance == 3
    assert cfg.ffn_dim == 64 and config_from_gigl(dict(KWARGS, activation="geglu")).ffn_dim == 42  # int(16 * 8/3)
    # the row count may come from the state_dict instead of an nn.Embedding
    kw = dict(KWARGS, anchor_based_input_embedding_dict={"hop_distance": None})
    sd = gigl_state_dict(KWARGS)
    assert from_gigl(sd, kw).config.hop_distance_embedding_size == 5
    assert isinstance(from_gigl(sd, cfg).config, GraphTransformerConfig)


@pytest.mark.parametrize("name,value", [
    ("pe_attr_names", ["random_walk_pe"]),
    ("pairwise_attention_bias_attr_names", ["hop_distance"]),
    ("relation_attention_mode", "edge_type_bilinear"),
    ("relation_message_mode", "edge_type_linear"),
    ("sequence_positional_encoding_type", "sinusoidal"),
    ("feature_embedding_layer_dict", torch.nn.ModuleDict()),
])
def test_unsupported_kwargs_are_refused(name, value):
    with pytest.raises(ConfigError, match=f"GiGL option {name}="):
        config_from_gigl(dict(KWARGS, **{name: value}))


def test_kwarg_errors():
    with pytest.raises(ConfigError, match="continuous token inputs"):
        config_from_gigl(dict(KWARGS, anchor_based_input_attr_names=["hop_distance", "ppr_weight"]))
    with pytest.raises(ConfigError, match="only a 'hop_distance' token embedding"):
        config_from_gigl(dict(KWARGS, anchor_based_input_attr_names=["deg"],
                              anchor_based_input_embedding_dict={"deg": torch.nn.Embedding(3, 16)}))
    with pytest.raises(ConfigError, match="lack 'hid_dim'"):
        config_from_gigl({k: v for k, v in KWARGS.items() if k != "hid_dim"})


def test_checkpoint_errors_name_the_key():
    sd = gigl_state_dict(KWARGS)
    bad = dict(sd)
    del bad["_final_norm.bias"]
    with pytest.raises(CheckpointError, match="missing 1 tensor.*_final_norm.bias"):
        from_gigl(bad, KWARGS)
    with pytest.raises(CheckpointError, match="unexpected tensor.*_extra.weight"):
        from_gigl(dict(sd, **{"_extra.weight": torch.zeros(1)}), KWARGS)
    bad = dict(sd, **{"_output_projection.weight": torch.zeros(9, 16)})
    with pytest.raises(CheckpointError, match=r"_output_projection.weight' has shape \(9, 16\)"):
        from_gigl(bad, KWARGS)
    with pytest.raises(CheckpointError, match="pairwise attention bias"):
        from_gigl(dict(sd, _pairwise_nonmissing_attention_bias=torch.zeros(4)), KWARGS)
    with pytest.raises(CheckpointError, match="relation-aware"):
        from_gigl(dict(sd, **{"_encoder_layers.0._relation_message_matrices": torch.zeros(1)}), KWARGS)
    with pytest.raises(CheckpointError, match="continuous token inputs"):
        from_gigl(dict(sd, **{"_token_input_projection.weight": torch.zeros(16, 1)}), KWARGS)
    lazy = dict(sd, **{"_output_projection.weight": torch.nn.parameter.UninitializedParameter()})
    with pytest.raises(CheckpointError, match="uninitialised LazyLinear"):
        from_gigl(lazy, KWARGS)
    with pytest.raises(CheckpointError, match="rows"):
        from_gigl(sd, dict(KWARGS, anchor_based_input_embedding_dict={"hop_distance": 7}))
    with pytest.raises(CheckpointError, match="missing"):  # kwargs say 3 layers, weights have 2
        from_gigl(sd, dict(KWARGS, num_layers=3))
