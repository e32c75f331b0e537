"""DeBERTa-v3 contenders of the `deberta` family (`python -m benchmarks deberta`).

Every system gets the same random fp16 weights: one host `DebertaParams` tree (packedenc) whose
HF state dict (`convert.hf.to_state_dict`) is loaded, key for key, into the transformers, FlashDeBERTa
and DisentangledFlash models.

- `packedenc` / `packedenc+graphs`: `packedenc.encode(backend="auto")`, eager and replayed from
  CUDA graphs (`packedenc.cudagraphs.graphed`; on a CPU the same bucketed buffers run eagerly).
- `hf-eager`: transformers `DebertaV2Model`, attn_implementation="eager" (DeBERTa has no other),
  right-padded to each batch's longest sequence.
- `flashdeberta`: FlashDeBERTa 0.0.8 `FlashDebertaV2Model` on the same padded batches (its own
  dispatch: padded kernel, varlen kernel when padding is present and L >= 1024).
- `disentangled-flash`: DisentangledFlash 1.1.1 packed path: `optimize_deberta(model, inference=True)`,
  HF embeddings run on the packed ids as one (1, T) row (exact for v3: no absolute positions;
  absolute ones are passed per token when a config has them), then `encoder.forward_packed(tokens,
  cu_seqlens, max_seqlen, packed_info=...)` with the host boundary info built outside the timed
  region (no device->host copy per call). Its packed path prepares (and keeps) position tables per
  exact max_seqlen on first sight, i.e. in the warm-up; they are dropped when the next workload
  starts (`encoder.clear_inference_cache()`), so `long`'s memory is not inflated by mnli's tables.
- `packedenc-ref-fp32`: the reference backend in fp32; runs only the probe batch (the oracle of
  the "min cos" column), never timed.

A peer that cannot be imported is recorded as absent ("pip install ..."); a peer that imports but
fails is recorded as failed with its error. Nothing here raises.

Shapes: T packed tokens, S sequences, L padded length, D hidden.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import torch
from torch import Tensor

import packedenc as pe
from benchmarks.common import AbsentSystem, Batch, System, Workload
from benchmarks.systems import GraphedSystem, HFPaddedSystem, PackedencSystem, hf_builder

# module -> pip requirement of the version the issue names
PEERS = {"flashdeberta": "flashdeberta==0.0.8", "disentangled_flash": "disentangled-flash==1.1.1"}
REFERENCE = "packedenc-ref-fp32"

# CPU smoke runs (--tiny): v3-base with head dim 32 (what the peers' kernels accept) and tiny buckets
DEBERTA_TINY = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=128, position_buckets=8, max_relative_positions=16)


def _resident_gb(device: torch.device) -> dict[str, float]:
    """Memory a system holds between calls (weights, caches), read right after its setup."""
    if device.type != "cuda":
        return {}
    return {"resident_gb": torch.cuda.memory_allocated(device) / 2**30}


def _load_exact(model: torch.nn.Module, sd: dict[str, Tensor], what: str) -> torch.nn.Module:
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{what} keys differ from packedenc's export: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}")
    return model.eval()


def flashdeberta_builder(host_params: Any, dtype: torch.dtype, flash: Any) -> Callable[[torch.device], Any]:
    """`build(device)` -> FlashDeBERTa's FlashDebertaV2Model (`flash`: the imported module) holding
    `host_params`' weights, in eval mode; FlashDeBERTa ships its own config class."""

    def build(device: torch.device) -> torch.nn.Module:
        from packedenc.convert.hf import to_state_dict

        sd, cfg_dict = to_state_dict(host_params)
        cfg = importlib.import_module("flashdeberta.model").DebertaV2Config(**cfg_dict)
        with torch.device(device):
            model = flash.FlashDebertaV2Model(cfg).to(dtype)
        return _load_exact(model, sd, "FlashDebertaV2Model")

    return build


def import_peer(module: str) -> tuple[Any, str | None]:
    """(module, None) when it imports, else (None, why): 'not installed (pip install ...)' or 'broken: ...'."""
    try:
        return importlib.import_module(module), None
    except ImportError as e:
        dep = getattr(e, "name", None)
        extra = f" (its dependency {dep!r} is missing)" if dep and dep.split(".")[0] != module else ""
        return None, f"not installed (pip install {PEERS[module]}){extra}"
    except Exception as e:  # noqa: BLE001 - an incompatible version must not end the run
        return None, f"broken: import {module} failed ({type(e).__name__}: {str(e)[:160]})"


def peer_version(module: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(PEERS[module].split("==")[0])
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- systems ------------------------------------------------------------------------------------


class PackedencDeberta(PackedencSystem):
    def info(self) -> dict[str, Any]:
        return {**super().info(), **_resident_gb(self.device)}


class GraphedDeberta(GraphedSystem):
    """packedenc from CUDA graphs, a budget per workload (see `GraphedSystem`)."""

    def info(self) -> dict[str, Any]:
        mode = "captured" if self.device.type == "cuda" else "eager buckets (no CUDA)"
        return {**super().info(), "graphs": mode, **_resident_gb(self.device)}


class ReferenceProbe(PackedencSystem):
    """packedenc's reference backend in fp32 on the probe batch only: the oracle of 'min cos'."""

    def setup(self) -> None:
        self.params = pe.tree_cast(pe.tree_to(self.host_params, self.device), torch.float32)

    def skip_reason(self, workload: Workload) -> str | None:
        return "probe oracle only (fp32 reference backend), not timed"

    def info(self) -> dict[str, Any]:
        return {"ops": "reference (fp32)"}


class HFPaddedDeberta(HFPaddedSystem):
    def __init__(self, *args: Any, extra: dict[str, Any] | None = None, needs_cuda: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.extra, self.needs_cuda = extra or {}, needs_cuda

    def skip_reason(self, workload: Workload) -> str | None:
        if self.needs_cuda and self.device.type != "cuda":
            return "its Triton kernels need a CUDA device"
        return super().skip_reason(workload)

    def info(self) -> dict[str, Any]:
        return {**super().info(), **self.extra, **_resident_gb(self.device)}


class DisentangledFlashPacked(System):
    """DisentangledFlash's packed encoder after HF embeddings (see the module docstring)."""

    def __init__(self, name: str, df: Any, build: Callable[[torch.device], Any], device: torch.device) -> None:
        self.name, self.df, self.build, self.device = name, df, build, device
        # its Triton kernels need CUDA; on a CPU its optimized PyTorch backend runs the same wiring
        self.backend = "triton" if device.type == "cuda" else "torch"
        self.model: Any = None
        self._workload: str | None = None

    def setup(self) -> None:
        model = self.build(self.device)
        # No `sequence_lengths`: forward_packed prepares its tables per exact max_seqlen anyway
        # (and re-prepares its layers on the first length it has no plan for), all in the warm-up.
        with torch.no_grad():
            self.df.optimize_deberta(model, backend=self.backend, inference=True)
        enc = model.encoder
        if not isinstance(enc, self.df.DebertaV2OptimizedEncoder) or enc.backend != self.backend:
            raise RuntimeError(
                f"optimize_deberta kept {type(enc).__name__} (backend {getattr(enc, 'backend', None)!r}, wanted "
                f"{self.backend!r}): Triton missing or head dim not in 32/64/128; not its optimized path"
            )
        self.model = model
        self.absolute = model.embeddings.position_embeddings is not None

    def skip_reason(self, workload: Workload) -> str | None:
        # asked first for every workload, before the memory counters reset (see GraphedDeberta)
        if self.model is not None and workload.name != self._workload:
            self.model.encoder.clear_inference_cache()
            self._workload = workload.name
        return None

    def prepare(self, batch: Batch) -> tuple[Tensor, Tensor, int, Any, Tensor | None]:
        from packedenc.packing import positions_from_cu_seqlens

        offsets = tuple(int(x) for x in batch.cu_seqlens.tolist())
        lengths = tuple(b - a for a, b in zip(offsets, offsets[1:]))
        info = self.df.PackedSequenceInfo(offsets, lengths, batch.max_seqlen)
        ids, cu = batch.ids.to(self.device), batch.cu_seqlens.to(self.device).contiguous()
        pos = positions_from_cu_seqlens(cu, ids.numel()) if self.absolute else None
        return ids, cu, batch.max_seqlen, info, pos

    def run(self, inputs: tuple[Tensor, Tensor, int, Any, Tensor | None]) -> Tensor:
        ids, cu, max_seqlen, info, pos = inputs
        emb_TD = self.model.embeddings(input_ids=ids[None], position_ids=None if pos is None else pos[None])[0]
        out = self.model.encoder.forward_packed(emb_TD, cu, max_seqlen, output_hidden_states=False,
                                                packed_info=info)
        return out.last_hidden_state

    def info(self) -> dict[str, Any]:
        enc = None if self.model is None else self.model.encoder
        tuning = getattr(getattr(enc, "tuning", None), "mode", None)
        return {"df_backend": self.backend, "df_tuning": tuning, "version": peer_version("disentangled_flash"),
                **_resident_gb(self.device)}

    def close(self) -> None:
        self.model = None


def make_systems(host_params: Any, device: torch.device) -> list[System]:
    """Every DeBERTa contender, in run order; the peers as found in this environment."""
    dtype = host_params.embeddings.layer_norm.weight.dtype
    pad_id = host_params.config.pad_token_id or 0
    systems: list[System] = [
        ReferenceProbe(REFERENCE, host_params, device, backend="reference"),
        PackedencDeberta("packedenc", host_params, device),
        # mnli / doc1k batches hold 16 sequences and <= 16 * 1024 tokens; "long" (8192) fits too
        GraphedDeberta("packedenc+graphs", host_params, device, max_tokens=16384, max_seqs=16),
        HFPaddedDeberta("hf-eager", hf_builder(host_params, dtype, "eager"), device, pad_id=pad_id),
    ]
    fd, why = import_peer("flashdeberta")
    if fd is None:
        systems.append(AbsentSystem("flashdeberta", why))
    else:
        systems.append(HFPaddedDeberta("flashdeberta", flashdeberta_builder(host_params, dtype, fd), device,
                                       pad_id=pad_id, extra={"version": peer_version("flashdeberta")},
                                       needs_cuda=True))
    df, why = import_peer("disentangled_flash")
    if df is None:
        systems.append(AbsentSystem("disentangled-flash", why))
    else:
        systems.append(DisentangledFlashPacked("disentangled-flash", df, hf_builder(host_params, dtype, "eager"),
                                               device))
    for module, pin in PEERS.items():
        have = peer_version(module)
        if have is not None and have != pin.split("==")[1]:
            print(f"note: {module} {have} is installed; the issue compares against {pin}")
    return systems
