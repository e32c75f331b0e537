"""Encoder inference: the `modernbert`, `deberta` and `bert` families, every system in one process.

    python -m benchmarks modernbert                  # H200: < ~6 min
    python -m benchmarks deberta                     # peers (DisentangledFlash, FlashDeBERTa) if installed
    python -m benchmarks bert --quick                # H200: < ~2 min
    python -m benchmarks modernbert --workloads query doc-64k --systems packedenc torch-packed

Weights are random (speed does not depend on their values), built in code from the public
configs: ModernBERT-base, DeBERTa-v3-base (fp16, as its peers run), BERT-base; no hub access.
Every system gets the same weights, and each record's `probe_min_cos` is the minimum per-token
cosine of its output against the family's reference system on one probe batch, so a system
computing something else shows. Workloads: `benchmarks/workloads.py`; `<name>-64k` is the same
sequences in token-budget packs (packed systems only: HF pads every batch).

Records: `results/<family>_<gpu>.json` with tokens_per_s, ms_per_batch, host_ms, device_ms,
peak_reserved_gb, peak_allocated_gb and the systems' own extras (`benchmarks/records.py`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch

from benchmarks import cli, common
from benchmarks.common import System, Workload, WorkloadSpec
from benchmarks.records import Run


@dataclasses.dataclass(frozen=True)
class ModelBench:
    title: str
    workloads: dict[str, WorkloadSpec]
    default_workloads: tuple[str, ...]
    make_params: Callable[[bool, torch.dtype], Any]  # (tiny, dtype) -> host params, random weights
    make_systems: Callable[[Any, torch.device], list[System]]
    reference: str  # the system whose probe output the others are compared with
    dtype: torch.dtype = torch.bfloat16


def _init(family: str, full: dict[str, Any], tiny: dict[str, Any]) -> Callable[[bool, torch.dtype], Any]:
    def make(is_tiny: bool, dtype: torch.dtype) -> Any:
        import packedenc as pe
        from packedenc.models import bert, deberta, modernbert

        kw = dict(tiny if is_tiny else full)
        if family == "modernbert":
            cfg = modernbert.ModernBertConfig(**kw)
        else:  # a preset with overrides
            presets = {"deberta": deberta.PRESETS, "bert": bert.PRESETS}[family]
            cfg = dataclasses.replace(presets[kw.pop("preset")], **kw)
        return pe.init(cfg, torch.Generator().manual_seed(0), dtype=dtype)

    return make


# packedenc's ModernBertConfig defaults are the public base config
MODERNBERT_TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=2, local_attention=16, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2, cls_token_id=1, sep_token_id=2)


def _modernbert_systems(host_params: Any, device: torch.device) -> list[System]:
    from benchmarks import baseline_modernbert
    from benchmarks.systems import (CompiledSystem, GraphedSystem, HFPaddedSystem, PackedencSystem, PackedFnSystem,
                                    hf_builder)

    hf = hf_builder(host_params, host_params.final_norm.weight.dtype)
    pad_id = host_params.config.pad_token_id or 0
    return [
        PackedencSystem("packedenc", host_params, device),
        # the fused RoPE + attention forward against the two ops it replaces (auto.py's evidence),
        # on the workload whose sequences it takes (<= 128 tokens)
        PackedencSystem("packedenc[triton]", host_params, device, backend="triton", only=("query",)),
        PackedencSystem("packedenc[triton,rope-unfused]", host_params, device, backend="triton",
                        unfused=("rotary_attention",), only=("query",)),
        GraphedSystem("packedenc+graphs", host_params, device, max_tokens=32768, max_seqs=256),
        CompiledSystem("packedenc+compile", host_params, device),
        PackedFnSystem("torch-packed", host_params, device, baseline_modernbert.encode, baseline_modernbert.prepare),
        HFPaddedSystem("hf-sdpa", hf, device, pad_id=pad_id),
        HFPaddedSystem("hf-sdpa+compile", hf, device, compile=True, pad_id=pad_id),
    ]


def _bert_systems(host_params: Any, device: torch.device) -> list[System]:
    from benchmarks.systems import CompiledSystem, GraphedSystem, HFPaddedSystem, PackedencSystem, hf_builder

    hf = hf_builder(host_params, host_params.embeddings.layer_norm.weight.dtype)
    pad_id = host_params.config.pad_token_id or 0
    return [
        PackedencSystem("packedenc", host_params, device),
        GraphedSystem("packedenc+graphs", host_params, device, max_tokens=32768, max_seqs=256),
        CompiledSystem("packedenc+compile", host_params, device),
        HFPaddedSystem("hf-sdpa", hf, device, pad_id=pad_id),
        HFPaddedSystem("hf-sdpa+compile", hf, device, compile=True, pad_id=pad_id),
    ]


def _deberta_systems(host_params: Any, device: torch.device) -> list[System]:
    from benchmarks import deberta_systems

    return deberta_systems.make_systems(host_params, device)


def _benches() -> dict[str, ModelBench]:
    from benchmarks import deberta_systems as ds
    from benchmarks.workloads import BERT_WORKLOADS, DEBERTA_WORKLOADS, MODERNBERT_WORKLOADS

    every = lambda specs: tuple(specs) + tuple(f"{n}-64k" for n in specs)  # noqa: E731
    return {
        "modernbert": ModelBench("ModernBERT-base inference", MODERNBERT_WORKLOADS, every(MODERNBERT_WORKLOADS),
                                 _init("modernbert", {}, MODERNBERT_TINY), _modernbert_systems, "torch-packed"),
        "deberta": ModelBench("DeBERTa-v3-base inference", DEBERTA_WORKLOADS, tuple(DEBERTA_WORKLOADS),
                              _init("deberta", dict(preset="v3-base"), dict(preset="v3-base", **ds.DEBERTA_TINY)),
                              _deberta_systems,
                              ds.REFERENCE, torch.float16),
        "bert": ModelBench("BERT-base inference", BERT_WORKLOADS, every(BERT_WORKLOADS),
                           _init("bert", dict(preset="base"), dict(preset="tiny")), _bert_systems, "hf-sdpa"),
    }


TINY_SPECS = {  # --tiny: the full run's workload names on a few short sequences
    "query": WorkloadSpec("query", 64, 24, 0.5, 4, 64, 16),
    "doc": WorkloadSpec("doc", 16, 60, 0.7, 16, 128, 4),
    "long": WorkloadSpec("long", 4, 100, 0.2, 64, 128, 2),
    "mnli": WorkloadSpec("mnli", 64, 12, 0.45, 2, 64, 16),
    "doc1k": WorkloadSpec("doc1k", 16, 40, 0.7, 8, 96, 4),
    "doc512": WorkloadSpec("doc512", 16, 40, 0.7, 8, 60, 4),
}


def _workloads(bench: ModelBench, names: list[str], vocab: int, args: Any) -> list[Workload]:
    specs = {k: TINY_SPECS[k] for k in bench.workloads} if args.tiny else bench.workloads
    try:
        return [common.workload_named(n, specs, vocab, args.seed, budget_scale=64 if args.tiny else 1)
                for n in names]
    except ValueError as e:
        raise SystemExit(str(e)) from None


def main(argv: list[str] | None, family: str) -> int:
    """`python -m benchmarks <family>` for family in modernbert, deberta, bert."""
    bench = _benches()[family]
    args = cli.add_passes(cli.parser(family, __doc__)).parse_args(argv)
    device = cli.device_of(args)
    if device is None:
        return 2
    run = Run.start(family, device, argv or [])
    _print_backends(device)
    t0 = time.perf_counter()
    dtype = torch.float32 if args.tiny else bench.dtype  # the CPU reference runs fp32
    host_params = bench.make_params(args.tiny, dtype)
    workloads = _workloads(bench, args.workloads or list(bench.default_workloads), host_params.config.vocab_size, args)
    for w in workloads:
        print(f"workload {w.name}: {len(w.lengths)} sequences, {w.num_tokens:,} tokens, {len(w.batches)} batches, "
              f"median length {sorted(w.lengths)[len(w.lengths) // 2]}")
    systems = cli.select(bench.make_systems(host_params, device), args.systems)
    cfg = cli.bench_config(args, device)
    probe = workloads[0].batch_of(workloads[0].batches[0][:16])
    model = {"modernbert": "modernbert-base", "deberta": "deberta-v3-base", "bert": "bert-base"}[family]
    fields = dict(model=model.replace("base", "tiny") if args.tiny else model, dtype=str(dtype).replace("torch.", ""))
    records, probes = common.run_passes(
        systems, args.passes, lambda system: common.run_system(system, workloads, cfg, run, probe, **fields))
    cos = common.probe_min_cos(probes, bench.reference)
    for r in records:
        r["probe_min_cos"] = cos.get(r["system"])
    print(f"\nmin cosine per token against {bench.reference} on a probe batch: "
          + ", ".join(f"{k} {'n/a' if v is None else f'{v:.5f}'}" for k, v in cos.items()))
    title = f"{bench.title}, {fields['dtype']} ({time.perf_counter() - t0:.0f}s); real tokens/s (peak reserved GB)"
    return cli.finish(run, records, args, title)


def _print_backends(device: torch.device) -> None:
    import packedenc as pe

    if device.type == "cuda":  # informative: which implementation each op of the table takes
        print("packedenc auto ops: " + ", ".join(f"{op}={b}" for op, b in pe.get_ops("auto", device).chosen))
