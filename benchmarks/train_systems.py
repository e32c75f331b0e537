"""The contenders of the `train` family: one MLM optimizer step (forward + backward + AdamW) each.

Every system holds fp32 master weights (the same host values for all of them) and an AdamW
(fused on CUDA) over them; compute runs in `compute_dtype` (bf16 on a GPU, fp32 on the CPU smoke
run): packedenc and the plain-torch baseline cast the params tree once per step with
`pe.tree_cast` (differentiable, so the gradients land on the fp32 leaves), the Hugging Face models
run under `torch.autocast`. Every system scores the MLM head on the masked rows only and takes the
mean cross-entropy in fp32; dropout is off everywhere (packedenc's Triton attention kernels take no
dropout, and equal losses across systems are the probe check).

Shapes: T packed tokens, S sequences, L padded length, D hidden, M masked tokens, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

import packedenc as pe
from benchmarks.common import Batch, System, Workload

LR = 1e-5  # small: the timed steps should not drive random weights anywhere strange


@dataclasses.dataclass
class TrainBatch(Batch):
    """One MLM batch on the host: packed masked ids plus which rows to predict."""

    positions: Tensor  # (M,) int64 packed rows to predict
    targets: Tensor  # (M,) int64 original ids there

    def padded_rows(self, pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
        """(input_ids (S, L), attention_mask (S, L), rows (M,) of the masked tokens in the flat S*L grid)."""
        ids_SL, mask_SL = self.padded(pad_id)
        seq_M = torch.searchsorted(self.cu_seqlens[1:].long(), self.positions, right=True)
        within_M = self.positions - self.cu_seqlens[:-1].long()[seq_M]
        return ids_SL, mask_SL, seq_M * self.max_seqlen + within_M


def mlm_batch(batch: Batch, mask_id: int, vocab_size: int, prob: float, seed: int) -> TrainBatch:
    """BERT-style masking (80/10/10) of a host batch, seeded per batch so every system sees the same."""
    from packedenc.train.losses import mask_tokens

    g = torch.Generator().manual_seed(seed)
    ids, pos, tgt = mask_tokens(batch.ids, mask_token_id=mask_id, vocab_size=vocab_size, prob=prob, generator=g)
    return TrainBatch(ids, batch.cu_seqlens, batch.max_seqlen, pos, tgt)


@dataclasses.dataclass
class MaskedWorkload(Workload):
    """A workload whose batches come masked (`mlm_batch`), seeded by the batch's first sequence, so
    every system sees the same masks."""

    mask_id: int = 0
    vocab_size: int = 0
    prob: float = 0.15

    def batch_of(self, idx: Any) -> TrainBatch:
        b = super().batch_of(idx)
        return mlm_batch(b, self.mask_id, self.vocab_size, self.prob, seed=1000 + idx[0])


def _trainable(host_params: Any, device: torch.device) -> Any:
    return torch.utils._pytree.tree_map(lambda t: t.detach().to(device, copy=True).requires_grad_(True), host_params)


def _adamw(leaves: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(leaves, lr=LR, weight_decay=0.01, fused=leaves[0].is_cuda)


class TrainSystem(System):
    """One contender: `setup` builds weights + optimizer, `prepare` stages a batch, `token_losses`
    is the forward (the probe), `run` one optimizer step. Each workload's record gets the loss of
    its first and last step (`extras`), which must be finite."""

    grad = True
    precision = "fp32 master weights, bf16 compute"

    def __init__(self, device: torch.device, compute_dtype: torch.dtype | None) -> None:
        self.device, self.compute = device, compute_dtype
        self.opt: torch.optim.Optimizer | None = None
        self.losses: list[Tensor] = []

    def token_losses(self, inputs: Any) -> Tensor:
        """(M,) fp32 cross-entropy of each masked token."""
        raise NotImplementedError

    def probe(self, inputs: Any) -> Tensor:
        return self.token_losses(inputs)

    def run(self, inputs: Any) -> Tensor:
        loss = self.token_losses(inputs).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(loss.detach())
        return self.losses[-1]

    def extras(self) -> dict[str, Any]:
        first, last = float(self.losses[0]), float(self.losses[-1])
        self.losses = []
        if last != last or last in (float("inf"), float("-inf")):
            raise RuntimeError(f"the training loss is not finite ({last})")
        return {"first_loss": first, "last_loss": last}

    def info(self) -> dict[str, Any]:
        return {"precision": self.precision}

    def close(self) -> None:
        self.opt = None
        self.losses = []


class GraphedStepTrain(TrainSystem):
    """`packedenc+graphs`: packedenc's graphed training step (forward, backward and AdamW replayed
    from one CUDA graph per bucket, issue 19).

    HOOK: packedenc has no graphed training step yet. When the library grows one, build it in
    `setup` from `PackedencTrain`'s loss and optimizer, replay it in `run`, and drop `absent`;
    until then every workload is recorded absent, so the records and targets show the gap.
    """

    name = "packedenc+graphs"
    absent = "packedenc has no graphed training step yet (issue 19; hook: train_systems.GraphedStepTrain)"


# ---- packed systems -----------------------------------------------------------------------------


class PackedencTrain(TrainSystem):
    """`pe.encode` + `pe.losses.mlm_token_losses` on the masked rows, one `tree_cast` per step."""

    def __init__(self, name: str, host_params: Any, device: torch.device, compute_dtype: torch.dtype | None,
                 backend: str = "auto", checkpoint: bool = False) -> None:
        super().__init__(device, compute_dtype)
        self.name, self.host_params, self.backend, self.checkpoint = name, host_params, backend, checkpoint
        self.optional = checkpoint  # the memory / speed trade-off, on request
        self.params: Any = None

    def setup(self) -> None:
        self.params = _trainable(self.host_params, self.device)
        self.opt = _adamw(torch.utils._pytree.tree_leaves(self.params))

    def prepare(self, b: TrainBatch) -> tuple[Any, ...]:
        d = self.device
        return b.ids.to(d), b.cu_seqlens.to(d), b.max_seqlen, b.positions.to(d), b.targets.to(d)

    def token_losses(self, inputs: tuple[Any, ...]) -> Tensor:
        from packedenc.train.losses import mlm_token_losses

        ids, cu, max_seqlen, pos, tgt = inputs
        # one differentiable cast shared by the encoder and the head (encode's compute_dtype would
        # cast the encoder's leaves only)
        p = self.params if self.compute is None else pe.tree_cast(self.params, self.compute)
        h_TD = pe.encode(p, ids, cu, max_seqlen, backend=self.backend, checkpoint=self.checkpoint)
        # the library's MLM loss: head on the masked rows; ModernBERT's decoder + cross-entropy fused
        # (ops.linear_cross_entropy: no (M, V) logits kept, in fp32 or at all)
        return mlm_token_losses(p, h_TD, pos, tgt, backend=self.backend)

    def info(self) -> dict[str, Any]:
        ops = pe.get_ops(self.backend, self.device)
        return {**super().info(), "ops": ",".join(f"{op}={b}" for op, b in ops.chosen), "checkpoint": self.checkpoint}

    def close(self) -> None:
        self.params = None
        super().close()


class TorchPackedTrain(PackedencTrain):
    """ModernBERT in plain torch (`baseline_modernbert.encode`: F.layer_norm, cuBLAS, RoPE tables,
    torch's flash varlen attention and its backward) with a plain-torch MLM head; autograd only."""

    def setup(self) -> None:
        from benchmarks import baseline_modernbert

        super().setup()
        with torch.no_grad():  # RoPE tables in the compute dtype, built once (not trained)
            dtype = self.compute or torch.float32
            self.rope = baseline_modernbert.prepare(pe.tree_cast(self.params, dtype)).rope

    def token_losses(self, inputs: tuple[Any, ...]) -> Tensor:
        from benchmarks import baseline_modernbert
        from packedenc.packing import positions_from_cu_seqlens

        ids, cu, max_seqlen, pos, tgt = inputs
        p = self.params if self.compute is None else pe.tree_cast(self.params, self.compute)
        cfg = p.config
        state = baseline_modernbert.State(p, self.rope)
        h_TD = baseline_modernbert.encode(state, ids, cu, max_seqlen, positions_from_cu_seqlens(cu, ids.numel()))
        h_MD = h_TD.index_select(0, pos)
        d, n = p.head.dense, p.head.norm
        act = pe.get_ops("reference").activation  # the plain-torch activation by HF name
        a_MD = F.layer_norm(act(F.linear(h_MD, d.weight, d.bias), cfg.classifier_activation),
                            (cfg.hidden_size,), n.weight, n.bias, cfg.norm_eps)
        w = p.embeddings.tok_embeddings.weight if p.decoder.weight is None else p.decoder.weight
        return F.cross_entropy(F.linear(a_MD, w, p.decoder.bias).float(), tgt, reduction="none")

    def info(self) -> dict[str, Any]:
        return {"precision": self.precision}

    def close(self) -> None:
        self.rope = None
        super().close()


# ---- Hugging Face systems (dynamic padding) ------------------------------------------------------


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
        self.opt = _adamw(list(self.model.parameters()))

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
