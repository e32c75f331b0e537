"""DeBERTa-v2/v3 key map: params leaf paths <-> HF `modeling_deberta_v2.py` state_dict keys.

Backbone keys sit under `deberta.` in task checkpoints (and Microsoft's releases) and at the top
in bare `DebertaV2Model` saves. Heads (`pooler.*`, `classifier.*`, `lm_predictions.*`, `cls.*`)
sit beside the backbone. The q/k/v projections of each layer are fused into one `qkv` leaf here
and split back (bit-identical) on save.
"""

from __future__ import annotations

from typing import Any

from packedenc.convert.hf import KeyMap

_QKV = ("query_proj", "key_proj", "value_proj")

KEYMAP = KeyMap(
    base_prefix="deberta.",
    anchor="embeddings.word_embeddings.weight",
    # Order matters: `attention` -> `attention.self` runs before `attention_output` is renamed.
    rename=(
        ("attention", "attention.self"),
        ("attention_output", "attention.output"),
        ("intermediate", "intermediate.dense"),
        ("layer_norm", "LayerNorm"),
    ),
    top_level=("pooler", "classifier", "lm_predictions", "cls"),
    roots=("embeddings", "encoder"),
    fused=(
        ("attention.qkv.weight", tuple(f"attention.{n}.weight" for n in _QKV)),
        ("attention.qkv.bias", tuple(f"attention.{n}.bias" for n in _QKV)),
    ),
    # Extras that Microsoft / older transformers checkpoints carry and nothing here reads. Anything
    # else that is not a params leaf is named as unexpected.
    ignore=(
        # v3 checkpoints keep the absolute position table although position_biased_input=false
        r"(deberta\.)?embeddings\.position_embeddings\.weight",
        # a persistent buffer in transformers < 4.31 saves
        r"(deberta\.)?embeddings\.position_ids",
        # the replaced-token-detection (ELECTRA-style discriminator) head of the v3 releases
        r"mask_predictions\..*",
        # tied copies of the word embeddings / cls.predictions.bias (tie_word_embeddings=true)
        r"cls\.predictions\.decoder\.(weight|bias)",
    ),
)


def detect_heads(keys_from_top: set[str], cfg: Any) -> tuple[str, ...]:
    heads = []
    if "classifier.weight" in keys_from_top and "pooler.dense.weight" in keys_from_top:
        heads.append("classifier")
    if "lm_predictions.lm_head.bias" in keys_from_top:
        heads.append("mlm")
    if "cls.predictions.bias" in keys_from_top:
        heads.append("mlm_legacy")
    return tuple(heads)


def heads_of(params: Any) -> tuple[str, ...]:
    return tuple(n for n in ("pooler", "classifier", "lm_predictions", "cls") if getattr(params, n) is not None)


def architecture(params: Any) -> str:
    if params.classifier is not None:
        return "DebertaV2ForSequenceClassification"
    if params.lm_predictions is not None or params.cls is not None:
        return "DebertaV2ForMaskedLM"
    return "DebertaV2Model"


def finish_config(params: Any, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """Make `legacy` agree with the MLM head the params carry, so DebertaV2ForMaskedLM builds that head.

    Microsoft's configs omit `legacy` (transformers then defaults to the cls.predictions head) while
    their weights carry lm_predictions.*.
    """
    if params.lm_predictions is not None and params.cls is None:
        cfg_dict["legacy"] = False
    elif params.cls is not None and params.lm_predictions is None:
        cfg_dict["legacy"] = True
    return cfg_dict
