"""Encoder throughput, every system in one process on the same seeded workloads.

    python -m benchmarks.encode --model modernbert-base            # full run (H200: < ~6 min)
    python -m benchmarks.encode --model modernbert-base --quick    # smaller (H200: < ~2 min)
    python -m benchmarks.encode --model modernbert-base --workloads query doc-64k --systems packedenc
    python -m benchmarks.encode --model deberta-v3-base           # issue 5: fp16, peers if installed

Weights are random (speed does not depend on their values), built from the public config in code:
no hub access. Prints real tokens/s and peak reserved memory per system, a table with the minimum
per-token cosine of each system against the reference system on one probe batch (all systems get
the same weights, so this catches a system computing something else), then writes
`benchmarks/results/<family>_<gpu>.json` (`..._quick.json` for --quick) and a PNG chart beside it.

Adding a model: a `ModelBench` in `MODELS` (config, params, workloads, systems, reference system).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import common
from benchmarks.common import BUDGET_TOKENS, BenchConfig, Batch, System, Workload, WorkloadSpec


@dataclasses.dataclass(frozen=True)
class ModelBench:
    key: str  # results file prefix ("modernbert", "deberta")
    workloads: dict[str, WorkloadSpec]
    make_params: Callable[[torch.dtype], Any]  # host params tree, random weights
    make_systems: Callable[[Any, torch.device], list[System]]
    reference: str  # system whose probe output the others are compared with
    dtype: torch.dtype = torch.bfloat16
    vocab_size: Callable[[Any], int] = lambda p: p.config.vocab_size
    default_workloads: tuple[str, ...] | None = None  # None: every workload, batched and in 64k packs
    report: Callable[[list[dict[str, Any]]], str] | None = None  # printed after the table (targets)


# ---- ModernBERT ---------------------------------------------------------------------------------


def _modernbert_params(cfg_kw: dict[str, Any]) -> Callable[[torch.dtype], Any]:
    def make(dtype: torch.dtype) -> Any:
        import packedenc as pe
        from packedenc.models import modernbert

        cfg = modernbert.ModernBertConfig(**cfg_kw)
        return pe.init(cfg, torch.Generator().manual_seed(0), dtype=dtype)

    return make


def _hf_modernbert(host_params: Any, dtype: torch.dtype) -> Callable[[torch.device], torch.nn.Module]:
    def build(device: torch.device) -> torch.nn.Module:
        import transformers

        from packedenc.convert.hf import to_state_dict

        sd, cfg_dict = to_state_dict(host_params)
        hf_cfg = transformers.ModernBertConfig.from_dict(cfg_dict)
        with torch.device(device):
            model = transformers.ModernBertModel._from_config(hf_cfg, attn_implementation="sdpa", dtype=dtype)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"HF ModernBertModel keys differ: missing {missing[:4]}, unexpected {unexpected[:4]}")
        return model.eval()

    return build


def _modernbert_systems(host_params: Any, device: torch.device) -> list[System]:
    from benchmarks import baseline_modernbert
    from benchmarks.systems import GraphedSystem, HFPaddedSystem, PackedencSystem, PackedFnSystem

    dtype = host_params.final_norm.weight.dtype
    pad_id = host_params.config.pad_token_id or 0
    hf = _hf_modernbert(host_params, dtype)
    return [
        PackedencSystem("packedenc", host_params, device),
        GraphedSystem("packedenc+graphs", host_params, device, max_tokens=32768, max_seqs=256),
        PackedFnSystem("torch-packed", host_params, device, baseline_modernbert.encode, baseline_modernbert.prepare),
        HFPaddedSystem("hf-sdpa", hf, device, pad_id=pad_id),
        HFPaddedSystem("hf-sdpa+compile", hf, device, compile=True, pad_id=pad_id),
    ]


MODERNBERT_BASE: dict[str, Any] = {}  # packedenc's ModernBertConfig defaults are the public base config
MODERNBERT_TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=2, local_attention=16, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2, cls_token_id=1, sep_token_id=2)
TINY_WORKLOADS = {  # CPU smoke test of the harness only
    "query": WorkloadSpec("query", 64, 24, 0.5, 4, 64, 16),
    "doc": WorkloadSpec("doc", 16, 60, 0.7, 16, 128, 4),
}


def _deberta(tiny: bool) -> ModelBench:
    from benchmarks import deberta_systems as ds

    workloads = ds.TINY_WORKLOADS if tiny else common.DEBERTA_WORKLOADS
    return ModelBench("deberta-tiny" if tiny else "deberta", workloads,
                      ds.make_params(ds.DEBERTA_TINY if tiny else ds.DEBERTA_V3_BASE), ds.make_systems,
                      reference=ds.REFERENCE, dtype=torch.float32 if tiny else torch.float16,
                      default_workloads=tuple(workloads), report=ds.target_report)


MODELS: dict[str, ModelBench] = {
    "modernbert-base": ModelBench("modernbert", common.MODERNBERT_WORKLOADS, _modernbert_params(MODERNBERT_BASE),
                                  _modernbert_systems, reference="torch-packed"),
    "modernbert-tiny": ModelBench("modernbert-tiny", TINY_WORKLOADS, _modernbert_params(MODERNBERT_TINY),
                                  _modernbert_systems, reference="torch-packed", dtype=torch.float32),
    # issue 5: the three DeBERTa workloads by default (`--workloads mnli-64k ...` adds packs)
    "deberta-v3-base": _deberta(tiny=False),
    "deberta-tiny": _deberta(tiny=True),  # CPU smoke test of the harness
}


# ---- the run ------------------------------------------------------------------------------------


def _workloads(bench: ModelBench, names: list[str] | None, vocab_size: int, seed: int) -> list[Workload]:
    budget_suffix = f"-{BUDGET_TOKENS // 1024}k"
    all_names = list(bench.workloads) + [n + budget_suffix for n in bench.workloads]
    names = names or list(bench.default_workloads or all_names)
    unknown = [n for n in names if n not in all_names]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {all_names}")
    out = []
    for n in names:
        base = n[: -len(budget_suffix)] if n.endswith(budget_suffix) else n
        budget = BUDGET_TOKENS if n != base else None
        out.append(common.make_workload(bench.workloads[base], vocab_size, seed, budget_tokens=budget))
    return out


def _probe(w: Workload) -> Batch:
    idx = w.batches[0][:16]  # a few sequences of the first workload, for the parity check
    return w.batch_of(idx)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.encode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="modernbert-base", choices=sorted(MODELS))
    ap.add_argument("--workloads", nargs="*", help="default: every workload, batched and in 64k-token packs (DeBERTa: the issue's three)")
    ap.add_argument("--systems", nargs="*", help="default: every system of the model")
    ap.add_argument("--quick", action="store_true", help="fewer, smaller repetitions (results in *_quick.json)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, help="timed repetitions (default 5, quick 3)")
    ap.add_argument("--target-tokens", type=int, help="real tokens per repetition (default 65536, quick 16384)")
    ap.add_argument("--out-dir", type=Path, default=common.RESULTS_DIR)
    ap.add_argument("--no-write", action="store_true", help="print only; write no JSON or chart")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU (use --device cpu --model modernbert-tiny or "
              "deberta-tiny to smoke-test the harness)")
        return 2
    bench = MODELS[args.model]
    cfg = BenchConfig(reps=args.reps or (3 if args.quick else 5),
                      target_tokens=args.target_tokens or (16384 if args.quick else 65536),
                      time_budget_s=5.0 if args.quick else 20.0, device=device)
    env = common.environment(device)
    commit = common.git_commit()
    print("command: python -m benchmarks.encode " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()) + f", commit={commit}")
    _print_backends(device)

    t0 = time.perf_counter()
    host_params = bench.make_params(bench.dtype)
    workloads = _workloads(bench, args.workloads, bench.vocab_size(host_params), args.seed)
    for w in workloads:
        print(f"workload {w.name}: {len(w.lengths)} sequences, {w.num_tokens:,} tokens, "
              f"{len(w.batches)} batches, median length {sorted(w.lengths)[len(w.lengths) // 2]}")
    systems = bench.make_systems(host_params, device)
    if args.systems:
        known = [s.name for s in systems]
        if set(args.systems) - set(known):
            raise SystemExit(f"unknown system(s) {sorted(set(args.systems) - set(known))}; choose from {known}")
        systems = [s for s in systems if s.name in args.systems]
    print(f"built params and workloads in {time.perf_counter() - t0:.1f}s")

    meta = dict(gpu=env["device"], commit=commit, model=args.model, dtype=str(bench.dtype).replace("torch.", ""),
                quick=args.quick, torch=env["torch"], triton=env.get("triton"),
                transformers=env.get("transformers"))
    records: list[dict[str, Any]] = []
    probes: dict[str, Any] = {}
    probe = _probe(workloads[0])
    for system in systems:
        recs, probes[system.name] = common.run_system(system, workloads, cfg, meta, probe)
        records += recs
    cos = common.probe_report(probes, bench.reference)
    for r in records:
        r["probe_min_cos"] = cos.get(r["system"])

    print(f"\n{args.model} on {env['device']} ({meta['dtype']}, commit {commit}, "
          f"{'quick' if args.quick else 'full'} run, {time.perf_counter() - t0:.0f}s); "
          f"real tokens/s (peak reserved GB), min cos vs {bench.reference} on a probe batch:")
    print(common.format_table(records, cos))
    if bench.report is not None:
        print("\n" + bench.report(records))
    if not args.no_write:
        stem = f"{bench.key}_{common.gpu_slug(env['device'])}{'_quick' if args.quick else ''}"
        path = args.out_dir / f"{stem}.json"
        merged = common.write_records(records, path)
        print(f"wrote {path}")
        title = f"{args.model}, {env['device']}, {meta['dtype']}, commit {commit}"
        png = common.plot(merged, args.out_dir / f"{stem}.png", title)
        if png:
            print(f"wrote {png}")
    return 0


def _print_backends(device: torch.device) -> None:
    try:
        from packedenc import kernels

        if device.type == "cuda":
            print(f"packedenc backends available: {kernels.available_backends(device)}; import errors: "
                  f"{getattr(kernels, '_IMPORT_ERRORS', {}) or 'none'}")
            print("packedenc auto ops: " + ", ".join(f"{op}={b}" for op, b in kernels.get_ops("auto", device).chosen))
    except Exception as e:  # noqa: BLE001 - informative only
        print(f"packedenc backends: could not list ({type(e).__name__}: {e})")


if __name__ == "__main__":
    raise SystemExit(main())
