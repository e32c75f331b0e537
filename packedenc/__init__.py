"""packedenc: pure-functional, padding-free encoders for PyTorch.

    import packedenc as pe
    params = pe.load("answerdotai/ModernBERT-base", dtype=torch.bfloat16, device="cuda")
    batch = pe.pack([[50281, 1234, 50282], [50281, 99, 100, 50282]])
    hidden = pe.encode(params, batch.ids, batch.cu_seqlens, batch.max_seqlen)   # (T, D)
"""

from __future__ import annotations

from typing import Any

from packedenc.convert.hf import load, save
from packedenc.text.embed import TokenEmbeddings, embed
from packedenc.cudagraphs import graphed, graphed_step
from packedenc.errors import (
    CheckpointError, CheckpointWarning, ConfigError, InputError, InputTypeError, PackedEncError,
)
from packedenc.kernels import Ops, get_ops
from packedenc.models import encode, family_of, init
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
from packedenc.text.sentence_transformers import SentenceModel, load_sentence_transformer
from packedenc.text.tokenizer import pack_texts, tokenizer

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
    "CheckpointWarning",
    "InputTypeError",
    "graphed",
    "graphed_step",
    "embed",
    "TokenEmbeddings",
    "tokenizer",
    "pack_texts",
    "load_sentence_transformer",
    "SentenceModel",
]

