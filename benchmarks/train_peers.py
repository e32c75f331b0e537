"""The training family's peers: Hugging Face models on padded batches and DisentangledFlash.

Same contract as `benchmarks/train_systems.py`: fp32 master weights with the same host values,
fused AdamW, compute under `torch.autocast` in `compute_dtype`, the MLM head scored on the masked
rows only, mean cross-entropy in fp32, dropout off.

Shapes: T packed tokens, S sequences, L padded length, D hidden, M masked tokens, V vocab.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.common import Workload
from benchmarks.train_systems import TrainBatch, TrainSystem, adamw


def hf_model(host_params: Any, device: torch.device, attn: str) -> torch.nn.Module:
    """The transformers *ForMaskedLM of `host_params`' family with exactly these weights, fp32, train mode."""
    import transformers

    from packedenc.convert.hf import to_state_dict

    sd, cfg_dict = to_state_dict(host_params)
    arch = {"modernbert": "ModernBertForMaskedLM", "deberta-v2": "DebertaV2ForMaskedLM"}[cfg_dict["model_type"]]
    cls = getattr(transformers, arch)
    hf_cfg = cls.config_class.from_dict(cfg_dict)
    with torch.device(device):
        model = cls._from_config(hf_cfg, attn_implementation=attn, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {n for n in missing if any(n == k for k in _tied_names(model))}
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"HF {arch} keys differ: missing {sorted(set(missing) - tied)[:4]}, "
                           f"unexpected {unexpected[:4]}")
    return model.train()


def _tied_names(model: torch.nn.Module) -> list[str]:
    """Parameter names that share storage with another (tied decoder weights)."""
    seen: dict[int, str] = {}
    out = []
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.append(n)
        seen.setdefault(id(p), n)
    return out


def hf_backbone_and_head(model: torch.nn.Module) -> tuple[Callable[..., Tensor], Callable[[Tensor], Tensor]]:
    """(backbone(input_ids, attention_mask) -> (S, L, D), head(h_MD) -> (M, V)) of an HF *ForMaskedLM."""
    if hasattr(model, "deberta"):
        emb = model.deberta.embeddings.word_embeddings
        head = model.cls if model.legacy else (lambda h: model.lm_predictions(h, emb))
        return lambda **kw: model.deberta(**kw).last_hidden_state, head
    return lambda **kw: model.model(**kw).last_hidden_state, lambda h: model.decoder(model.head(h))


class HFTrain(TrainSystem):
    """A transformers MLM model on right-padded batches (each padded to its longest sequence), fp32
    weights under `torch.autocast(bf16)`; token-budget packs are skipped (HF pads every batch)."""

    def __init__(self, name: str, host_params: Any, device: torch.device, compute_dtype: torch.dtype | None,
                 *, attn: str, pad_id: int = 0) -> None:
        super().__init__(device, compute_dtype)
        self.name, self.host_params, self.attn, self.pad_id = name, host_params, attn, pad_id
        self.model: Any = None
        self.precision = "fp32 master weights, torch.autocast bf16" if compute_dtype else "fp32"

    def build(self) -> torch.nn.Module:
        return hf_model(self.host_params, self.device, self.attn)

    def setup(self) -> None:
        self.model = self.build()
        self.backbone, self.head = hf_backbone_and_head(self.model)
        self.opt = adamw(list(self.model.parameters()))

    def skip_reason(self, workload: Workload) -> str | None:
        return "token-budget packs are for packed systems (HF pads every batch)" if workload.budget else None

    def prepare(self, b: TrainBatch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        ids, mask, rows = b.padded_rows(self.pad_id)
        d = self.device
        return ids.to(d), mask.to(d), rows.to(d), b.targets.to(d)

    def token_losses(self, inputs: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
        ids, mask, rows, tgt = inputs
        with torch.autocast(self.device.type, dtype=self.compute or torch.float32, enabled=self.compute is not None):
            h_SLD = self.backbone(input_ids=ids, attention_mask=mask)
            logits_MV = self.head(h_SLD.reshape(-1, h_SLD.shape[-1]).index_select(0, rows))
        return F.cross_entropy(logits_MV.float(), tgt, reduction="none")

    def info(self) -> dict[str, Any]:
        return {**super().info(), "attn_implementation": self.attn}

    def close(self) -> None:
        self.model = self.backbone = self.head = None
        super().close()


def disentangled_flash_version() -> str | None:
    try:
        import disentangled_flash
    except ImportError:
        return None
    return getattr(disentangled_flash, "__version__", "unknown")


class DisentangledFlashTrain(HFTrain):
    """HF DeBERTa with DisentangledFlash's training path, `optimize_deberta(model.deberta,
    inference=False)`, on the same padded batches as HF (its drop-in use)."""

    def __init__(self, name: str, host_params: Any, device: torch.device, compute_dtype: torch.dtype | None,
                 **kw: Any) -> None:
        super().__init__(name, host_params, device, compute_dtype, attn="eager", **kw)
        version = disentangled_flash_version()
        if version is None:
            self.absent = "not installed (pip install disentangled-flash==1.1.1)"
        elif device.type != "cuda":
            self.absent = "not on the CPU (its training path is Triton on CUDA)"

    def build(self) -> torch.nn.Module:
        from disentangled_flash import optimize_deberta

        model = super().build()
        optimize_deberta(model.deberta, inference=False)
        enc = model.deberta.encoder
        if type(enc).__name__ != "DebertaV2OptimizedEncoder" or getattr(enc, "backend", None) != "triton":
            raise RuntimeError(f"DisentangledFlash kept {type(enc).__name__} (backend "
                               f"{getattr(enc, 'backend', None)}): its Triton training path is not active")
        return model.train()

    def info(self) -> dict[str, Any]:
        return {**super().info(), "disentangled_flash": disentangled_flash_version()}


class DisentangledFlashPackedTrain(DisentangledFlashTrain):
    """DisentangledFlash's packed training path (`encoder.forward_packed` over cu_seqlens) on the
    packed batches and the 64k-token packs: HF embeddings on the packed ids, no padding anywhere."""

    def skip_reason(self, workload: Workload) -> str | None:
        return None

    def prepare(self, b: TrainBatch) -> tuple[Any, ...]:
        from disentangled_flash import PackedSequenceInfo

        cu = b.cu_seqlens.tolist()
        info = PackedSequenceInfo(tuple(cu), tuple(e - s for s, e in zip(cu, cu[1:])), b.max_seqlen)
        d = self.device
        return b.ids.to(d), b.cu_seqlens.to(d), info, b.positions.to(d), b.targets.to(d)

    def token_losses(self, inputs: tuple[Any, ...]) -> Tensor:
        ids, cu, info, pos, tgt = inputs
        deb = self.model.deberta
        with torch.autocast(self.device.type, dtype=self.compute or torch.float32, enabled=self.compute is not None):
            h_TD = deb.embeddings(input_ids=ids[None])[0]  # v3: no absolute positions, so packing is exact
            h_TD = deb.encoder.forward_packed(h_TD, cu, info.max_seqlen, output_hidden_states=False,
                                              packed_info=info).last_hidden_state
            logits_MV = self.head(h_TD.index_select(0, pos))
        return F.cross_entropy(logits_MV.float(), tgt, reduction="none")
