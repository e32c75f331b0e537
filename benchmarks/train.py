"""Training throughput: one MLM optimizer step (forward + backward + AdamW) per batch, every system
in one process on the same seeded sequences, the same weights and the same masks.

    python -m benchmarks train                               # both models (H200: < ~8 min)
    python -m benchmarks train --models modernbert-base      # one model
    python -m benchmarks train --workloads doc doc-b8 --systems packedenc torch-packed
    python -m benchmarks train --tiny --device cpu           # CPU smoke run of the harness (fp32)

Precision: fp32 master weights and a fused AdamW over them for every system; bf16 compute on a GPU
(packedenc and the plain-torch baseline cast the params tree per step, HF runs under autocast).
Dropout is off. The MLM head is scored on the masked rows only (30% masked for ModernBERT, 15% for
DeBERTa), mean cross-entropy in fp32.

Workloads (`benchmarks/workloads.py`): ModernBERT-base on `doc` (batches of 32 sequences),
`doc-b8` (the same sequences in batches of 8), `query` (batches of 128 short sequences) and
`doc-64k` (the doc sequences in token-budget packs; packed systems only); DeBERTa-v3-base on
`doc1k` (batches of 16) and `doc1k-64k`.

Systems: `packedenc` (the eager step, backend auto), `packedenc+graphs` (the same step through
`packedenc.cudagraphs.graphed_step`; absent where packedenc has none), `torch-packed` (plain
torch through autograd, torch's flash varlen backward), `hf-sdpa` / `hf-eager` (transformers,
dynamic padding), `disentangled-flash` (padded) and `disentangled-flash-packed` (absent when not
installed), `packedenc+checkpoint` (per-layer recompute; only when named), `packedenc[auto,no-cute]`
(ModernBERT, CUDA, only when named: the eager step on the table `auto` builds without the cute extra, the
A/B of the extra's rows in training; with the extra installed, `packedenc` takes them),
`packedenc+graphs[auto,no-cute]` (the same, graphed), `packedenc[auto,train-global]` and
`packedenc+graphs[auto,train-global]` (ModernBERT, CUDA, only
when named: `auto` with FA4's unchosen training row, `auto.train_global`, taken: the measurement
that row waits for). Probe: before any step, each
system's per-token losses on one batch against the reference system's (same weights and masks:
they must agree to bf16 noise), recorded as `probe_rel_diff`.

Records: `results/train_<gpu>.json`: model, system, workload, tokens_per_s, ms_per_batch (one
step), host_ms / device_ms of one step, peak memory, first / last loss, probe loss and difference.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch

from benchmarks import cli, common
from benchmarks import train_peers as tp
from benchmarks import train_systems as ts
from benchmarks.common import WorkloadSpec
from benchmarks.records import Run, rate_cell


@dataclasses.dataclass(frozen=True)
class TrainBench:
    specs: dict[str, WorkloadSpec]
    workloads: tuple[str, ...]  # the default ones
    make_params: Callable[[bool], Any]  # (tiny) -> host fp32 params with an MLM head
    make_systems: Callable[[Any, torch.device, torch.dtype | None], list[ts.TrainSystem]]
    reference: str  # the probe's reference system
    mask_id: int  # tiny: the last id
    mask_prob: float


def _params(family: str) -> Callable[[bool], Any]:
    def make(tiny: bool) -> Any:
        import packedenc as pe
        from benchmarks.encode import MODERNBERT_TINY
        from packedenc.models import deberta, modernbert

        if family == "modernbert":
            cfg = modernbert.ModernBertConfig(**(MODERNBERT_TINY if tiny else {}))
        else:  # dropout off (see the module docstring); Microsoft's MLM head layout (lm_predictions)
            cfg = dataclasses.replace(deberta.PRESETS["tiny" if tiny else "v3-base"], hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, legacy=False)
        return pe.init(cfg, torch.Generator().manual_seed(0), heads=("mlm",))

    return make


def _modernbert_systems(host: Any, device: torch.device, dt: torch.dtype | None) -> list[ts.TrainSystem]:
    pad = host.config.pad_token_id or 0
    return [ts.PackedencTrain("packedenc", host, device, dt), ts.GraphedStepTrain(host, device, dt),
            ts.TorchPackedTrain("torch-packed", host, device, dt),
            tp.HFTrain("hf-sdpa", host, device, dt, attn="sdpa", pad_id=pad),
            ts.PackedencTrain("packedenc+checkpoint", host, device, dt, checkpoint=True),
            ts.PackedencTrain("packedenc[auto,no-cute]", host, device, dt, no_cute=True),
            ts.PackedencTrain("packedenc[auto,train-global]", host, device, dt, candidate="train-global"),
            ts.GraphedStepTrain(host, device, dt, candidate="train-global"),
            ts.GraphedStepTrain(host, device, dt, no_cute=True)]


def _deberta_systems(host: Any, device: torch.device, dt: torch.dtype | None) -> list[ts.TrainSystem]:
    pad = host.config.pad_token_id or 0
    return [ts.PackedencTrain("packedenc", host, device, dt), ts.GraphedStepTrain(host, device, dt),
            tp.HFTrain("hf-eager", host, device, dt, attn="eager", pad_id=pad),
            tp.DisentangledFlashTrain("disentangled-flash", host, device, dt, pad_id=pad),
            tp.DisentangledFlashPackedTrain("disentangled-flash-packed", host, device, dt, pad_id=pad),
            ts.PackedencTrain("packedenc+checkpoint", host, device, dt, checkpoint=True)]


def benches() -> dict[str, TrainBench]:
    from benchmarks.workloads import DEBERTA_WORKLOADS, MODERNBERT_WORKLOADS

    return {
        "modernbert-base": TrainBench({k: MODERNBERT_WORKLOADS[k] for k in ("doc", "query")},
                                      ("doc", "doc-b8", "query", "doc-64k"), _params("modernbert"),
                                      _modernbert_systems, "torch-packed", 50284, 0.3),
        "deberta-v3-base": TrainBench({"doc1k": DEBERTA_WORKLOADS["doc1k"]}, ("doc1k", "doc1k-64k"),
                                      _params("deberta"), _deberta_systems, "hf-eager", 128000, 0.15),
    }


TINY_SPECS = {  # --tiny: the full run's workload names on a few short sequences
    "doc": WorkloadSpec("doc", 16, 60, 0.7, 16, 128, 4),
    "query": WorkloadSpec("query", 32, 12, 0.5, 4, 32, 16),
    "doc1k": WorkloadSpec("doc1k", 16, 40, 0.7, 8, 100, 4),
}


def workloads(bench: TrainBench, names: list[str], vocab: int, args: Any) -> list[ts.MaskedWorkload]:
    specs = {k: TINY_SPECS[k] for k in bench.specs} if args.tiny else bench.specs
    mask_id = vocab - 1 if args.tiny else bench.mask_id
    out = []
    for n in names:
        w = common.workload_named(n, specs, vocab, args.seed, budget_scale=64 if args.tiny else 1)
        out.append(ts.MaskedWorkload(w.name, w.lengths, w.tokens, w.batches, w.budget, mask_id=mask_id,
                                     vocab_size=vocab - 1 if args.tiny else vocab, prob=bench.mask_prob))
    return out


def probe_diffs(probes: dict[str, torch.Tensor | None], reference: str) -> dict[str, tuple[float, float | None]]:
    """system -> (mean probe loss, max |per-token loss - reference's| / reference's mean loss).

    Per-token losses, not just the mean: at random init every model's mean loss is near ln(V), but
    per-token losses spread by the logits' scale, so a system computing a different function
    differs by about that spread, while bf16 rounding moves them by far less."""
    ref = probes.get(reference)
    out = {}
    for name, t in probes.items():
        if t is not None:
            same = ref is not None and ref.shape == t.shape
            out[name] = (float(t.mean()), float((t - ref).abs().max() / ref.mean().abs()) if same else None)
    return out


def _parse(argv: list[str] | None) -> Any:
    ap = cli.add_passes(cli.parser("train", __doc__))
    ap.add_argument("--models", nargs="*", choices=sorted(benches()), help="default: both")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    device = cli.device_of(args)
    if device is None:
        return 2
    run = Run.start("train", device, argv or [])
    cfg = cli.bench_config(args, device)
    cfg.reps = args.reps or (2 if args.tiny else 3)  # a step is long: fewer repetitions than inference
    compute = torch.bfloat16 if device.type == "cuda" else None  # fp32 on the CPU: the probe is exact there
    t0, records, known = time.perf_counter(), [], set()
    for model, bench in benches().items():
        if args.models and model not in args.models:
            continue
        names = [n for n in (args.workloads or bench.workloads)
                 if n.split("-")[0] in bench.specs]  # each model runs the names of its own workloads
        if not names:
            continue
        host = bench.make_params(args.tiny)
        ws = workloads(bench, names, host.config.vocab_size, args)
        systems = bench.make_systems(host, device, compute)
        known |= {s.name for s in systems}
        systems = cli.select(systems, args.systems, strict=False)
        probe = ws[0].batch(0)
        fields = dict(model=model.replace("base", "tiny") if args.tiny else model,
                      compute_dtype=str(compute or torch.float32).replace("torch.", ""))
        recs, probes = common.run_passes(systems, args.passes,
                                         lambda s: common.run_system(s, ws, cfg, run, probe, **fields))
        records += recs
        for name, (loss, diff) in probe_diffs(probes, bench.reference).items():
            shown = "n/a" if diff is None else f"{diff:.2e}"
            print(f"{fields['model']} {name}: first-step loss {loss:.5f}, "
                  f"max |per-token loss - {bench.reference}'s| / mean {shown}")
            for r in records:
                if (r["model"], r["system"]) == (fields["model"], name):
                    r["probe_loss"], r["probe_rel_diff"] = loss, diff
    if set(args.systems or ()) - known:
        print(f"note: unknown system(s) {sorted(set(args.systems) - known)} ignored; known: {sorted(known)}")
    title = f"training step ({time.perf_counter() - t0:.0f}s); real tokens/s (peak reserved GB)"
    return cli.finish(run, records, args, title, fmt=rate_cell, rows=("model", "system"))
