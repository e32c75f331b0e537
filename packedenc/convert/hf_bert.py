"""BERT / RoBERTa / XLM-R key maps: params leaf paths <-> HF `modeling_{bert,roberta}.py` keys.

Backbone keys sit under `bert.` / `roberta.` in task checkpoints (…ForMaskedLM,
…ForSequenceClassification) and at the top in `BertModel` saves and sentence-transformers
backbones. q / k / v are fused into one (3D, D) `qkv` leaf at load and split again at save.
The MLM decoder is tied to the word embeddings (and its bias to the head's `bias`); the tied
copies, NSP weights and the `position_ids` buffer some old exports keep are skipped.
"""

from __future__ import annotations

from typing import Any

from packedenc.convert.hf import KeyMap

_FUSED = tuple(
    (f"attention.qkv.{w}", tuple(f"attention.self.{n}.{w}" for n in ("query", "key", "value")))
    for w in ("weight", "bias")
)
# Ordered: the generic LayerNorm rename must run before a head's rename produces "layer_norm".
_BACKBONE_RENAMES = (("layers", "encoder.layer"), ("layer_norm", "LayerNorm"), ("pooler", "pooler.dense"))
_IGNORE = (r"(.*\.)?embeddings\.position_ids", r"(.*\.)?embeddings\.token_type_ids")

BERT_KEYMAP = KeyMap(
    base_prefix="bert.",
    anchor="embeddings.word_embeddings.weight",
    rename=_BACKBONE_RENAMES + (
        ("mlm.dense", "cls.predictions.transform.dense"),
        ("mlm.norm", "cls.predictions.transform.LayerNorm"),
        ("mlm.bias", "cls.predictions.bias"),
        ("mlm.decoder", "cls.predictions.decoder.weight"),
        ("classifier.out_proj", "classifier"),
    ),
    top_level=("mlm", "classifier"),
    fused=_FUSED,
    roots=("embeddings", "encoder", "pooler"),
    ignore=_IGNORE + (r"cls\.predictions\.decoder\.(weight|bias)", r"cls\.seq_relationship\..*"),
)

ROBERTA_KEYMAP = KeyMap(
    base_prefix="roberta.",
    anchor="embeddings.word_embeddings.weight",
    rename=_BACKBONE_RENAMES + (
        ("mlm.dense", "lm_head.dense"),
        ("mlm.norm", "lm_head.layer_norm"),
        ("mlm.bias", "lm_head.bias"),
        ("mlm.decoder", "lm_head.decoder.weight"),
    ),
    top_level=("mlm", "classifier"),
    fused=_FUSED,
    roots=("embeddings", "encoder", "pooler"),
    ignore=_IGNORE + (r"lm_head\.decoder\.(weight|bias)",),
)

KEYMAP = BERT_KEYMAP


def keymap_for(cfg: Any) -> KeyMap:
    return ROBERTA_KEYMAP if cfg.is_roberta else BERT_KEYMAP


def detect_heads(keys_from_top: set[str], cfg: Any) -> tuple[str, ...]:
    heads = []
    if any(k == "pooler.dense.weight" or k.endswith(".pooler.dense.weight") for k in keys_from_top):
        heads.append("pooler")
    if "cls.predictions.bias" in keys_from_top or "lm_head.bias" in keys_from_top:
        heads.append("mlm")
    if "classifier.weight" in keys_from_top or "classifier.out_proj.weight" in keys_from_top:
        heads.append("classifier")
    return tuple(heads)


def heads_of(params: Any) -> tuple[str, ...]:
    """Heads that live beside the backbone (they decide whether keys get the `bert.` prefix)."""
    return tuple(n for n in ("mlm", "classifier") if getattr(params, n) is not None)


def architecture(params: Any) -> str:
    prefix = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}[params.config.model_type]
    if params.classifier is not None:
        return prefix + "ForSequenceClassification"
    if params.mlm is not None:
        return prefix + "ForMaskedLM"
    return prefix + "Model"
