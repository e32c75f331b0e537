"""DeBERTa-v2/v3 family (model_type "deberta-v2"): config, params, packed encode, heads.

    import packedenc as pe
    params = pe.load("microsoft/deberta-v3-base")
    batch = pe.pack([[1, 2650, 2], [1, 7, 8, 2]])
    hidden = pe.encode(params, batch.ids, batch.cu_seqlens, batch.max_seqlen)   # (T, 768)

Modules: `config` (DebertaConfig, PRESETS), `params` (the tree, params_spec, init), `model`
(encode, layers, heads). The disentangled attention itself is the `deberta_attention` op.
"""

from __future__ import annotations

from typing import Any

from packedenc.models.deberta.config import MODEL_TYPES, PRESETS, DebertaConfig
from packedenc.models.deberta.model import classify, encode, max_seqlen_limit, mlm_head, mlm_logits
from packedenc.models.deberta.params import HEADS, DebertaParams, init, params_spec

__all__ = [
    "MODEL_TYPES",
    "PRESETS",
    "HEADS",
    "DebertaConfig",
    "DebertaParams",
    "params_spec",
    "init",
    "encode",
    "max_seqlen_limit",
    "classify",
    "mlm_head",
    "mlm_logits",
    "config_from_hf",
]


def config_from_hf(d: dict[str, Any]) -> DebertaConfig:
    return DebertaConfig.from_hf(d)
