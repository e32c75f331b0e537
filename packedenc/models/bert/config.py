"""BERT / RoBERTa / XLM-R config: HF config.json fields, what the packed math honours, presets."""

from __future__ import annotations

import dataclasses
from typing import Any

from packedenc.errors import ConfigError
from packedenc.kernels.reference import check_activation

MODEL_TYPES = ("bert", "roberta", "xlm-roberta")
ROBERTA_TYPES = ("roberta", "xlm-roberta")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BertConfig:
    model_type: str = "bert"  # "bert" | "roberta" | "xlm-roberta": decides the position offset
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1  # training only (with `dropout_seed`), as HF's train mode
    attention_probs_dropout_prob: float = 0.1
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    tie_word_embeddings: bool = True
    id2label: tuple[tuple[int, str], ...] = ()  # classifier label names, kept for round trips
    architectures: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"not a BERT-family model_type: {self.model_type!r}; expected one of {MODEL_TYPES}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.is_roberta and self.pad_token_id is None:
            raise ConfigError(f"{self.model_type} needs pad_token_id: its positions start at pad_token_id + 1")
        if self.max_positions <= 0:
            raise ConfigError(
                f"max_position_embeddings {self.max_position_embeddings} leaves no position after the "
                f"offset {self.position_offset}"
            )
        check_activation(self.hidden_act)

    @property
    def is_roberta(self) -> bool:
        return self.model_type in ROBERTA_TYPES

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def position_offset(self) -> int:
        """Row of the position table used for position 0 (pad_token_id + 1 for RoBERTa / XLM-R)."""
        return self.pad_token_id + 1 if self.is_roberta else 0

    @property
    def max_positions(self) -> int:
        """Longest sequence the position table can hold (512 for bert-base and roberta-base)."""
        return self.max_position_embeddings - self.position_offset

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "BertConfig":
        """Build from an HF config.json dict. Raises `ConfigError` on what the math does not honour."""
        if d.get("model_type") not in MODEL_TYPES:
            raise ConfigError(f"not a BERT / RoBERTa / XLM-R config: model_type={d.get('model_type')!r}")
        pet = d.get("position_embedding_type", "absolute")
        if pet not in (None, "absolute"):
            raise ConfigError(
                f"position_embedding_type={pet!r} is not supported (absolute positions only); "
                "transformers 5 dropped relative_key(_query) as well"
            )
        for flag in ("is_decoder", "add_cross_attention"):
            if d.get(flag):
                raise ConfigError(f"{flag}=true is not supported: packedenc runs BERT as a bidirectional encoder")
        act = d.get("hidden_act", "gelu")
        if not isinstance(act, str):
            raise ConfigError(f"hidden_act must be a name, got {act!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names and k not in ("id2label", "architectures")}
        for k in ("eos_token_id", "bos_token_id"):
            if isinstance(kw.get(k), list):
                kw[k] = kw[k][0] if kw[k] else None
        id2label = tuple(sorted((int(k), str(v)) for k, v in (d.get("id2label") or {}).items()))
        return cls(**kw, id2label=id2label, architectures=tuple(d.get("architectures") or ()))

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers loads to the same model."""
        d = dataclasses.asdict(self)
        d["position_embedding_type"] = "absolute"
        d["architectures"] = list(self.architectures) or [_ARCH_PREFIX[self.model_type] + "Model"]
        if self.id2label:
            d["id2label"] = {str(i): n for i, n in self.id2label}
            d["label2id"] = {n: i for i, n in self.id2label}
        else:
            d.pop("id2label")
        return d


_ARCH_PREFIX = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}

PRESETS = {
    "tiny": BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=64),
    "minilm-l6": BertConfig(hidden_size=384, num_hidden_layers=6, intermediate_size=1536),
    "base": BertConfig(),
}


def config_from_hf(d: dict[str, Any]) -> BertConfig:
    return BertConfig.from_hf(d)
