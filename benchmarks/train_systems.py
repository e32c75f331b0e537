"""The contenders of the `train` family: one MLM optimizer step (forward + backward + AdamW) each.

Every system holds fp32 master weights (the same host values for all of them) and an AdamW
(torch's fused kernel on CUDA) over them; compute runs in `compute_dtype` (bf16 on a GPU, fp32 on the CPU smoke
run): packedenc's step casts them once per micro-batch outside autograd (`make_step(compute_dtype=)`,
one multi-tensor copy; the gradients widened into fp32 sums), the plain-torch baseline with
`pe.tree_cast` (differentiable, so the gradients land on the fp32 leaves), the Hugging Face models
under `torch.autocast`. Every system scores the MLM head on the masked rows only and takes the
mean cross-entropy in fp32; dropout is off everywhere (packedenc's Triton attention kernels take no
dropout, and equal losses across systems are the probe check).

Shapes: T packed tokens, S sequences, L padded length, D hidden, M masked tokens, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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


def adamw(leaves: list[Tensor]) -> torch.optim.Optimizer:
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


# ---- packed systems -----------------------------------------------------------------------------


class PackedencTrain(TrainSystem):
    """packedenc's own training step, eagerly: `make_step(mlm_loss, AdamW, compute_dtype=...)` and
    `step.update_(state, batch)` (the library's default training path; `pe.encode` + `mlm_loss`
    on the masked rows, one multi-tensor bf16 cast of the fp32 master weights a step, torch's fused
    AdamW kernel). `packedenc+graphs` replays the same step from CUDA graphs."""

    def __init__(self, name: str, host_params: Any, device: torch.device, compute_dtype: torch.dtype | None,
                 backend: str = "auto", checkpoint: bool = False, no_cute: bool = False,
                 candidate: str | None = None) -> None:
        super().__init__(device, compute_dtype)
        self.name, self.host_params, self.backend, self.checkpoint = name, host_params, backend, checkpoint
        self.no_cute = no_cute  # auto's table as it is without the cute extra (made in setup: CUDA only)
        # auto's table with varlen_attention's unchosen row of this shape class taken (made in setup)
        self.candidate = candidate
        # the memory / speed trade-off, the extra's A/B, a candidate row: on request
        self.optional = checkpoint or no_cute or candidate is not None
        if (no_cute or candidate) and torch.device(device).type != "cuda":
            self.absent = "auto's table without the cute extra or with a candidate row is a CUDA table"
        self.fn: Any = None
        self.state: Any = None

    def setup(self) -> None:
        from packedenc.train import AdamW, TrainState, make_step

        if self.no_cute:
            from benchmarks.cute_common import auto_without_cute

            self.backend = auto_without_cute()
        if self.candidate:
            from benchmarks.cute_common import auto_with_candidate

            self.backend = auto_with_candidate("varlen_attention", self.candidate)
        # fp32 master weights owned by the state, a copy: its in-place updates must not reach the host tree
        params = torch.utils._pytree.tree_map(lambda t: t.detach().to(self.device, copy=True), self.host_params)
        self.fn = make_step(self._loss, AdamW(lr=LR, weight_decay=0.01), compute_dtype=self.compute)
        self.state = TrainState.create(params, self.fn.optimizer)

    def _loss(self, params: Any, batch: dict[str, Any]) -> Tensor:
        from packedenc.train.losses import mlm_loss

        b = batch["text"]  # params: cast to the compute dtype by the step
        h_TD = pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, b.positions, backend=self.backend,
                         checkpoint=self.checkpoint)
        # the library's MLM loss: head on the masked rows; ModernBERT's decoder + cross-entropy fused
        # (ops.linear_cross_entropy: no (M, V) logits kept, in fp32 or at all)
        return mlm_loss(params, h_TD, batch["pos"], batch["tgt"], backend=self.backend)

    def prepare(self, b: TrainBatch) -> dict[str, Any]:
        from packedenc.packing import Packed, positions_from_cu_seqlens

        d = self.device
        pos_T = positions_from_cu_seqlens(b.cu_seqlens, b.num_tokens)
        text = Packed(b.ids.to(d), b.cu_seqlens.to(d), pos_T.to(d), b.max_seqlen)
        return {"text": text, "pos": b.positions.to(d), "tgt": b.targets.to(d)}

    def token_losses(self, inputs: dict[str, Any]) -> Tensor:
        from packedenc.train.losses import mlm_token_losses

        t = inputs["text"]
        p = self.state.params if self.compute is None else pe.tree_cast(self.state.params, self.compute)
        h_TD = pe.encode(p, t.ids, t.cu_seqlens, t.max_seqlen, t.positions, backend=self.backend)
        return mlm_token_losses(p, h_TD, inputs["pos"], inputs["tgt"], backend=self.backend)

    def run(self, inputs: dict[str, Any]) -> Tensor:
        self.losses.append(self.fn.update_(self.state, inputs))
        return self.losses[-1]

    def info(self) -> dict[str, Any]:
        ops = pe.get_ops(self.backend, self.device)
        return {**super().info(), "ops": ",".join(f"{op}={b}" for op, b in ops.chosen), "checkpoint": self.checkpoint}

    def close(self) -> None:
        self.fn = self.state = None
        super().close()


class TorchPackedTrain(TrainSystem):
    """ModernBERT in plain torch (`baseline_modernbert.encode`: F.layer_norm, cuBLAS, RoPE tables,
    torch's flash varlen attention and its backward) with a plain-torch MLM head; autograd, one
    differentiable `tree_cast` a step, torch's fused AdamW."""

    def __init__(self, name: str, host_params: Any, device: torch.device, compute_dtype: torch.dtype | None) -> None:
        super().__init__(device, compute_dtype)
        self.name, self.host_params = name, host_params
        self.params: Any = None
        self.rope: Any = None

    def setup(self) -> None:
        from benchmarks import baseline_modernbert

        self.params = _trainable(self.host_params, self.device)
        self.opt = adamw(torch.utils._pytree.tree_leaves(self.params))
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

    def prepare(self, b: TrainBatch) -> tuple[Any, ...]:
        d = self.device
        return b.ids.to(d), b.cu_seqlens.to(d), b.max_seqlen, b.positions.to(d), b.targets.to(d)

    def close(self) -> None:
        self.rope = self.params = None
        super().close()


class GraphedStepTrain(PackedencTrain):
    """`packedenc+graphs`: the `packedenc` step replayed by `packedenc.cudagraphs.graphed_step`: per
    bucket one CUDA graph for forward + backward and one for the update (on a CPU the same padded
    phases run eagerly). Each workload gets its own graphed step, budgeted to its largest batch,
    over the one training state. Recorded absent where packedenc has no graphed step."""

    def __init__(self, host_params: Any, device: torch.device, compute_dtype: torch.dtype | None,
                 candidate: str | None = None, no_cute: bool = False) -> None:
        name = "packedenc+graphs" + (f"[auto,{candidate}]" if candidate else "[auto,no-cute]" if no_cute else "")
        super().__init__(name, host_params, device, compute_dtype, candidate=candidate, no_cute=no_cute)
        try:
            from packedenc.cudagraphs import graphed_step  # noqa: F401 - is it there?
        except ImportError:
            self.absent = "packedenc has no graphed training step here (packedenc.cudagraphs.graphed_step)"
        self.jstep = None
        self._workload: str | None = None
        self.warmup_passes = 3  # graphed_step runs a bucket's first 2 uses eagerly, captures on the 3rd

    def skip_reason(self, workload: Workload) -> str | None:
        # asked first for every workload, before the memory counters reset: where its graphs start
        if self.state is not None and workload.name != self._workload:
            from packedenc.cudagraphs import Pad, graphed_step

            self.jstep = None  # the previous workload's graphs and pool
            tokens = max(workload.batch_tokens(i) for i in range(len(workload.batches)))
            seqs = max(map(len, workload.batches))
            self.jstep = graphed_step(self.fn, self.state, max_tokens=tokens, max_seqs=seqs,
                                      pad={"pos": Pad("masked", 0), "tgt": Pad("masked", -100)})
            self._workload = workload.name
        return None

    def run(self, inputs: dict[str, Any]) -> Tensor:
        self.losses.append(self.jstep(inputs))
        return self.losses[-1]

    def close(self) -> None:
        self.jstep = None
        self._workload = None
        super().close()
