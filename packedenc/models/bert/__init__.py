"""BERT / RoBERTa / XLM-R family (model_types "bert", "roberta", "xlm-roberta"): config, params, encode, heads.

Modules: `config` (BertConfig, PRESETS), `params` (the tree, params_spec, init), `model` (encode,
layers, heads: pooler, mlm_head / mlm_logits, classify).
"""

from packedenc.models.bert.config import MODEL_TYPES, PRESETS, ROBERTA_TYPES, BertConfig, config_from_hf
from packedenc.models.bert.model import (classify, embed_tokens, encode, layer, max_seqlen_limit, mlm_head, mlm_logits,
                                         pooler)
from packedenc.models.bert.params import BertParams, init, params_spec

__all__ = ["MODEL_TYPES", "ROBERTA_TYPES", "PRESETS", "BertConfig", "BertParams", "params_spec", "init",
           "encode", "max_seqlen_limit", "layer", "embed_tokens", "pooler", "mlm_head", "mlm_logits", "classify",
           "config_from_hf"]
