"""ModernBERT key map: params leaf paths <-> HF `modeling_modernbert.py` state_dict keys.

Backbone keys sit under `model.` in task checkpoints (ModernBertForMaskedLM, ...ForSequence-
Classification) and at the top in sentence-transformers / PyLate backbones. Heads (`head.*`,
`decoder.*`, `classifier.*`) sit beside the backbone. The MLM decoder weight is tied to the token
embeddings and usually not stored; when it is stored and the config ties it, it is skipped.
"""

from __future__ import annotations

from typing import Any

from packedenc.convert.hf import KeyMap

KEYMAP = KeyMap(
    base_prefix="model.",
    anchor="embeddings.tok_embeddings.weight",
    rename=(("wqkv", "Wqkv"), ("wo", "Wo"), ("wi", "Wi")),
    top_level=("head", "decoder", "classifier"),
    roots=("embeddings", "layers", "final_norm"),
    # decoder.weight: tied copy of the embeddings; rotary inv_freq: buffers some exports keep.
    ignore=(r"decoder\.weight", r"(.*\.)?rotary_emb\..*inv_freq"),
)


def detect_heads(keys_from_top: set[str], cfg: Any) -> tuple[str, ...]:
    heads = []
    mlm_arch = any(a.endswith("ForMaskedLM") for a in cfg.architectures)
    if "decoder.bias" in keys_from_top or "decoder.weight" in keys_from_top or (
        mlm_arch and "head.dense.weight" in keys_from_top
    ):
        heads.append("mlm")
    if "classifier.weight" in keys_from_top:
        heads.append("classifier")
    if not heads and "head.dense.weight" in keys_from_top:
        heads.append("head")
    return tuple(heads)


def heads_of(params: Any) -> tuple[str, ...]:
    return tuple(n for n in ("head", "decoder", "classifier") if getattr(params, n) is not None)


def architecture(params: Any) -> str:
    if params.classifier is not None:
        return "ModernBertForSequenceClassification"
    if params.decoder is not None:
        return "ModernBertForMaskedLM"
    return "ModernBertModel"
