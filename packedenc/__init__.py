"""packedenc: pure-functional, padding-free encoders for PyTorch.

    import packedenc as pe
    params = pe.load("answerdotai/ModernBERT-base", dtype=torch.bfloat16, device="cuda")
    batch = pe.pack([[50281, 1234, 50282], [50281, 99, 100, 50282]])
    hidden = pe.encode(params, batch.ids, batch.cu_seqlens, batch.max_seqlen)   # (T, D)
"""

from __future__ import annotations

from typing import Any

from packedenc.convert.hf import load, save
from packedenc.embed import TokenEmbeddings, embed
from packedenc.errors import CheckpointError, ConfigError, InputError, PackedEncError
from packedenc.kernels import Ops, get_ops
from packedenc.models import family_of
from packedenc.packing import (
    Packed,
    pack,
    pack_padded,
    pad,
    pool,
    pool_first,
    pool_max,
    pool_mean,
    token_budget_batches,
    unpack,
)
from packedenc.pytree import num_params, tree_cast, tree_to
from packedenc.sentence_transformers import SentenceModel, load_sentence_transformer
from packedenc.tokenize import pack_texts, tokenizer

__version__ = "0.1.0"

__all__ = [
    "load",
    "save",
    "encode",
    "init",
    "pack",
    "pack_padded",
    "unpack",
    "pad",
    "pool",
    "pool_first",
    "pool_mean",
    "pool_max",
    "token_budget_batches",
    "Packed",
    "Ops",
    "get_ops",
    "tree_cast",
    "tree_to",
    "num_params",
    "PackedEncError",
    "InputError",
    "ConfigError",
    "CheckpointError",
    "embed",
    "TokenEmbeddings",
    "tokenizer",
    "pack_texts",
    "load_sentence_transformer",
    "SentenceModel",
]


def encode(params: Any, *args: Any, **kwargs: Any) -> Any:
    """Run the encoder of whatever family `params` belongs to. Pure: no state, no mutation.

    For token models (ModernBERT, DeBERTa, BERT):
        encode(params, ids, cu_seqlens, max_seqlen=None, positions=None, *, backend="auto", validate=False)
        ids: (T,) int, cu_seqlens: (S+1,) int32, max_seqlen: host int -> hidden states (T, D).
    For the graph transformer (GiGL's GraphTransformerEncoder):
        encode(params, x, cu_seqlens, max_seqlen=None, *, hops=None, node_types=None, key_features=None,
               return_tokens=False, ...) -> one embedding per sequence (S, out_dim), anchor first.
    See the family module's `encode` (packedenc.models.<family>.encode) for the extras it takes.
    """
    return family_of(params).encode(params, *args, **kwargs)


def init(config: Any, generator: Any = None, **kwargs: Any) -> Any:
    """Random params for a config object of any family (for tests, benchmarks, training from scratch)."""
    from packedenc.models import family_for_model_type

    return family_for_model_type(config.to_hf()["model_type"]).init(config, generator, **kwargs)
