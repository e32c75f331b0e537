"""DeBERTa-v2/v3 config: the fields of HF `config.json` that change the math, checked once.

Defaults are the ones `transformers/models/deberta_v2/modeling_deberta_v2.py` (5.24) falls back to
when a field is absent (`getattr(config, ..., default)`), not the v3 checkpoints' values:
`relative_attention=False`, `position_buckets=-1`, `share_att_key=False`, `norm_rel_ebd="none"`,
`position_biased_input=True`. Microsoft's raw configs spell `pos_att_type` as "p2c|c2p".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from packedenc.errors import ConfigError
from packedenc.kernels.reference import check_activation

MODEL_TYPES = ("deberta-v2",)
_POS_ATT_TYPES = ("c2p", "p2c")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DebertaConfig:
    vocab_size: int = 128100
    hidden_size: int = 1536
    num_hidden_layers: int = 24
    num_attention_heads: int = 24
    intermediate_size: int = 6144
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 0
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-7
    hidden_dropout_prob: float = 0.1  # training only (with `dropout_seed`), HF's train-mode sites
    attention_probs_dropout_prob: float = 0.1  # reference attention only (the Triton kernel has none)
    relative_attention: bool = False
    max_relative_positions: int = -1  # < 1 means max_position_embeddings
    position_buckets: int = -1  # > 0: log buckets, and the tables have 2 * position_buckets rows
    norm_rel_ebd: str = "none"  # "layer_norm" (possibly "|"-joined): LayerNorm on rel_embeddings
    share_att_key: bool = False  # position tables projected by the layer's query/key projections
    pos_att_type: tuple[str, ...] = ()  # subset of ("c2p", "p2c"), in the checkpoint's order
    position_biased_input: bool = True  # absolute position embeddings added to the input
    embedding_size: int | None = None  # None: hidden_size (no embed_proj)
    attention_head_size: int | None = None  # None: hidden_size // num_attention_heads
    conv_kernel_size: int = 0  # > 0: the ConvLayer after layer 0 (deberta-v2-xlarge / xxlarge)
    conv_groups: int = 1
    conv_act: str = "tanh"
    pooler_hidden_act: str = "gelu"
    legacy: bool = True  # HF's MLM head flavour (cls.predictions vs lm_predictions)
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    id2label: tuple[tuple[int, str], ...] = ()  # classifier label names, kept for round trips
    architectures: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        D, H = self.hidden_size, self.num_attention_heads
        if H <= 0 or D % H:
            raise ConfigError(f"hidden_size {D} is not divisible by num_attention_heads {H}")
        if self.head_dim * H != D:
            raise ConfigError(
                f"attention_head_size {self.attention_head_size} x {H} heads != hidden_size {D}: "
                "transformers' attention output projection is (hidden, hidden), so this checkpoint cannot run"
            )
        bad = [t for t in self.pos_att_type if t not in _POS_ATT_TYPES]
        if bad:
            raise ConfigError(
                f"pos_att_type {list(self.pos_att_type)} has {bad}: DeBERTa-v2 implements only 'c2p' and "
                "'p2c' (transformers silently ignores others such as v1's 'p2p'); remove them from config.json"
            )
        if len(set(self.pos_att_type)) != len(self.pos_att_type):
            raise ConfigError(f"pos_att_type {list(self.pos_att_type)} repeats an entry")
        bad = [x for x in self.norm_rel_ebd_parts if x not in ("none", "layer_norm")]
        if bad:
            raise ConfigError(f"norm_rel_ebd {self.norm_rel_ebd!r}: unknown part(s) {bad}; use 'layer_norm' or 'none'")
        if self.relative_attention and self.position_buckets > 0:
            mid = self.position_buckets // 2
            if mid < 1 or self.max_relative - 1 <= mid:
                raise ConfigError(
                    f"position_buckets={self.position_buckets} with max_relative_positions={self.max_relative}: "
                    "the log buckets divide by log((max_relative_positions - 1) / (position_buckets // 2)), which "
                    "must be positive; use position_buckets >= 2 and max_relative_positions > "
                    "position_buckets // 2 + 1"
                )
        if self.conv_kernel_size < 0 or (self.conv_kernel_size and self.conv_kernel_size % 2 == 0):
            raise ConfigError(
                f"conv_kernel_size {self.conv_kernel_size} must be 0 (no conv) or odd: with an even kernel the "
                "padding (k - 1) // 2 shortens the sequence and transformers fails too"
            )
        if self.conv_kernel_size and (self.conv_groups < 1 or D % self.conv_groups):
            raise ConfigError(f"conv_groups {self.conv_groups} must divide hidden_size {D}")
        if self.type_vocab_size < 0:
            raise ConfigError(f"type_vocab_size must be >= 0, got {self.type_vocab_size}")
        check_activation(self.hidden_act)
        check_activation(self.pooler_hidden_act)
        if self.conv_kernel_size:
            check_activation(self.conv_act)

    # ---- derived values ------------------------------------------------------------------------

    @property
    def head_dim(self) -> int:
        return self.attention_head_size or self.hidden_size // self.num_attention_heads

    @property
    def emb_size(self) -> int:
        return self.embedding_size or self.hidden_size

    @property
    def max_relative(self) -> int:
        """max_relative_positions as HF resolves it (< 1 falls back to max_position_embeddings)."""
        return self.max_relative_positions if self.max_relative_positions >= 1 else self.max_position_embeddings

    @property
    def att_span(self) -> int:
        """Half the number of rows of rel_embeddings (HF's pos_ebd_size)."""
        return self.position_buckets if self.position_buckets > 0 else self.max_relative

    @property
    def norm_rel_ebd_parts(self) -> tuple[str, ...]:
        return tuple(x.strip() for x in self.norm_rel_ebd.lower().split("|"))

    @property
    def attention_pos_types(self) -> tuple[str, ...]:
        """The position terms the attention computes (none without relative_attention)."""
        return self.pos_att_type if self.relative_attention else ()

    @property
    def scale(self) -> float:
        """1 / sqrt(K * (1 + |pos_att_type|)); HF counts pos_att_type even without relative_attention."""
        return _scale(self.head_dim, 1 + len(self.pos_att_type))

    @property
    def num_labels(self) -> int:
        return len(self.id2label) or 2

    # ---- HF config.json ------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "DebertaConfig":
        """Build from an HF config.json dict (raw Microsoft or HF-saved). Raises on what we can't honour."""
        if d.get("model_type") not in MODEL_TYPES:
            raise ConfigError(f"not a DeBERTa-v2/v3 config: model_type={d.get('model_type')!r}")
        D = d.get("hidden_size", 1536)
        pooler = d.get("pooler_hidden_size")
        if pooler not in (None, D):
            raise ConfigError(
                f"pooler_hidden_size {pooler} != hidden_size {D}: the ContextPooler reads hidden states of size "
                "hidden_size, so transformers cannot run this classifier either"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        skip = ("pos_att_type", "id2label", "architectures", "norm_rel_ebd")
        kw = {k: v for k, v in d.items() if k in names and k not in skip and v is not None}
        pos = d.get("pos_att_type") or ()
        if isinstance(pos, str):
            pos = pos.split("|")
        id2label = tuple(sorted((int(k), str(v)) for k, v in (d.get("id2label") or {}).items()))
        return cls(
            **kw,
            pos_att_type=tuple(str(x).strip().lower() for x in pos),
            norm_rel_ebd=str(d.get("norm_rel_ebd") or "none"),
            id2label=id2label,
            architectures=tuple(d.get("architectures") or ()),
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers loads to the same model."""
        d = dataclasses.asdict(self)
        d["model_type"] = "deberta-v2"
        d["pos_att_type"] = list(self.pos_att_type)
        d["pooler_hidden_size"] = self.hidden_size
        for k in ("embedding_size", "attention_head_size"):
            if d[k] is None:
                d.pop(k)
        d["architectures"] = list(self.architectures) or ["DebertaV2Model"]
        if self.id2label:
            d["id2label"] = {str(i): n for i, n in self.id2label}
            d["label2id"] = {n: i for i, n in self.id2label}
        else:
            d.pop("id2label")
        return d


_V3 = dict(relative_attention=True, position_buckets=256, norm_rel_ebd="layer_norm", share_att_key=True,
           pos_att_type=("p2c", "c2p"), position_biased_input=False, max_relative_positions=-1)
PRESETS: dict[str, DebertaConfig] = {
    "tiny": DebertaConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, **{**_V3, "position_buckets": 8, "max_relative_positions": 16}),
    "v3-xsmall": DebertaConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                               intermediate_size=1536, attention_head_size=64, **_V3),
    "v3-base": DebertaConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, **_V3),
    "v3-large": DebertaConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, **_V3),
    "mdeberta-v3-base": DebertaConfig(vocab_size=251000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                      intermediate_size=3072, **_V3),
    "v2-xlarge": DebertaConfig(attention_head_size=64, conv_kernel_size=3, conv_act="gelu", **_V3),
}


_SCALES: dict[tuple[int, int], float] = {}


def _scale(head_dim: int, factor: int) -> float:
    """HF's sqrt(K * factor) in float32, inverted; cached: every layer of every forward asks (a
    torch.tensor and sqrt each time cost ~10 us of host time per layer). A plain dict, which
    torch.compile traces (it warns on lru_cache)."""
    out = _SCALES.get((head_dim, factor))
    if out is None:
        out = _SCALES[head_dim, factor] = 1.0 / float(torch.sqrt(torch.tensor(head_dim, dtype=torch.float32) * factor))
    return out
