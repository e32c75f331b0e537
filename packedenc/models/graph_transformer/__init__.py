"""Graph transformer family: GiGL's `GraphTransformerEncoder` as a pure packed function.

    cfg = GraphTransformerConfig(node_type_to_feat_dim_map={"user": 64}, hid_dim=128, num_heads=4)
    params = init(cfg)
    seqs = packedenc.models.graph_transformer.khop_sequences(anchors, edge_index, num_hops=2, max_seq_len=128)
    emb = packedenc.encode(params, node_x[seqs.index], seqs.cu_seqlens, seqs.max_seqlen)   # (S, out_dim)

Modules: `config` (the config), `params` (GiGL-named params tree, spec, init), `forward` (encode,
layers, readout). GiGL checkpoints: `packedenc.convert.gigl`.
"""

from packedenc.models.graph_transformer.config import MODEL_TYPE, GraphTransformerConfig
from packedenc.models.graph_transformer.forward import encode, layer, project_nodes, readout
from packedenc.models.graph_transformer.khop import KhopSequences, khop_sequences
from packedenc.models.graph_transformer.params import (
    EncoderLayer,
    FeedForward,
    GraphTransformerParams,
    init,
    params_spec,
)

MODEL_TYPES = (MODEL_TYPE,)

__all__ = [
    "GraphTransformerConfig",
    "GraphTransformerParams",
    "EncoderLayer",
    "FeedForward",
    "params_spec",
    "init",
    "encode",
    "layer",
    "readout",
    "project_nodes",
    "config_from_hf",
    "khop_sequences",
    "KhopSequences",
]


def config_from_hf(d: dict) -> GraphTransformerConfig:
    """Config from its dict form (`GraphTransformerConfig.to_dict()`); GiGL kwargs: convert.gigl."""
    return GraphTransformerConfig.from_dict(d)
