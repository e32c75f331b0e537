"""Training throughput: one MLM optimizer step (forward + backward + AdamW) per batch, every system in
one process on the same seeded sequences and the same weights (issue 7).

    python -m benchmarks.train                              # full run (H200: < ~5 min)
    python -m benchmarks.train --models modernbert-base --systems packedenc torch-packed
    python -m benchmarks.train --tiny --device cpu          # CPU smoke run of the harness (fp32)

Precision: fp32 master weights and a fused AdamW over them for every system; bf16 compute on a GPU
(packedenc and the plain-torch baseline cast the params tree per step, HF runs under autocast).
Dropout is off. The MLM head is scored on the masked rows only (30% masked for ModernBERT, 15% for
DeBERTa), mean cross-entropy in fp32.

Workloads: ModernBERT-base on `doc` (common.MODERNBERT_WORKLOADS), DeBERTa-v3-base on `doc1k`
(common.DEBERTA_WORKLOADS). `<name>` is the spec's batches (32 / 16 sequences; HF pads each to its
longest sequence, packed systems pack the same sequences), `<name>-64k` the same sequences in
token-budget packs of <= 65,536 tokens (packed systems only).

Systems: `packedenc` (backend auto), `torch-packed` (benchmarks/baseline_modernbert.py through
autograd, torch's flash varlen backward), `hf-sdpa` / `hf-eager` (transformers, dynamic padding),
`packedenc+checkpoint` (per-layer activation checkpointing; only when named in --systems),
`disentangled-flash` (`optimize_deberta(model.deberta, inference=False)` on HF's padded batches)
and `disentangled-flash-packed` (its `encoder.forward_packed`), recorded as absent when the
package is not installed. Probe: before any step, each system's per-token losses on one batch are
compared with the reference system's (same weights, same masks: they must agree to bf16 noise).

Records: benchmarks/results/train_<gpu>.json (`train_cpu_tiny.json` for --tiny) with system, model,
workload, step_ms, tokens_per_s, peak_reserved_gb, gpu, commit; then the issue's targets, ok/missed.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import common
from benchmarks import train_systems as ts
from benchmarks.common import Workload, WorkloadSpec

TINY_BUDGET = 1024  # --tiny: "64k" packs become 1k-token packs


@dataclasses.dataclass(frozen=True)
class TrainBench:
    model: str  # record's `model`
    spec: WorkloadSpec
    make_params: Callable[[], Any]  # host fp32 params with an MLM head
    make_systems: Callable[[Any, torch.device, torch.dtype | None], list[ts.TrainSystem]]
    reference: str  # the probe's reference system
    mask_id: int
    mask_prob: float


def _modernbert_params(tiny: bool) -> Callable[[], Any]:
    def make() -> Any:
        import packedenc as pe
        from benchmarks.encode import MODERNBERT_BASE, MODERNBERT_TINY
        from packedenc.models import modernbert

        cfg = modernbert.ModernBertConfig(**(MODERNBERT_TINY if tiny else MODERNBERT_BASE))
        return pe.init(cfg, torch.Generator().manual_seed(0), heads=("mlm",))

    return make


def _deberta_params(tiny: bool) -> Callable[[], Any]:
    def make() -> Any:
        import packedenc as pe
        from packedenc.models import deberta

        base = deberta.PRESETS["tiny" if tiny else "v3-base"]
        # dropout off (see the module docstring); Microsoft's MLM head layout (lm_predictions)
        cfg = dataclasses.replace(base, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, legacy=False)
        return pe.init(cfg, torch.Generator().manual_seed(0), heads=("mlm",))

    return make


def _modernbert_systems(host: Any, device: torch.device, dt: torch.dtype | None) -> list[ts.TrainSystem]:
    pad = host.config.pad_token_id or 0
    return [ts.PackedencTrain("packedenc", host, device, dt), ts.TorchPackedTrain("torch-packed", host, device, dt),
            ts.HFTrain("hf-sdpa", host, device, dt, attn="sdpa", pad_id=pad),
            ts.PackedencTrain("packedenc+checkpoint", host, device, dt, checkpoint=True)]


def _deberta_systems(host: Any, device: torch.device, dt: torch.dtype | None) -> list[ts.TrainSystem]:
    pad = host.config.pad_token_id or 0
    return [ts.PackedencTrain("packedenc", host, device, dt), ts.HFTrain("hf-eager", host, device, dt, attn="eager",
                                                                          pad_id=pad),
            ts.DisentangledFlashTrain("disentangled-flash", host, device, dt, pad_id=pad),
            ts.DisentangledFlashPackedTrain("disentangled-flash-packed", host, device, dt, pad_id=pad),
            ts.PackedencTrain("packedenc+checkpoint", host, device, dt, checkpoint=True),
            ts.PackedencTrain("packedenc[bwd=pair]", host, device, dt, switches={"ONE_PASS": False})]


def benches(tiny: bool) -> dict[str, TrainBench]:
    if tiny:
        from benchmarks.encode import TINY_WORKLOADS

        doc1k = WorkloadSpec("doc1k", 16, 40, 0.7, 8, 100, 4)
        return {
            "modernbert-tiny": TrainBench("modernbert-tiny", TINY_WORKLOADS["doc"], _modernbert_params(True),
                                          _modernbert_systems, "torch-packed", 999, 0.3),
            "deberta-tiny": TrainBench("deberta-tiny", doc1k, _deberta_params(True), _deberta_systems, "hf-eager",
                                       999, 0.15),
        }
    return {
        "modernbert-base": TrainBench("modernbert-base", common.MODERNBERT_WORKLOADS["doc"], _modernbert_params(False),
                                      _modernbert_systems, "torch-packed", 50284, 0.3),
        "deberta-v3-base": TrainBench("deberta-v3-base", common.DEBERTA_WORKLOADS["doc1k"], _deberta_params(False),
                                      _deberta_systems, "hf-eager", 128000, 0.15),
    }


def workloads(bench: TrainBench, vocab: int, budget: int, seed: int = 0) -> list[Workload]:
    """The spec's batches, then the same sequences in token-budget packs named '<spec>-<budget/1024>k'."""
    batched = common.make_workload(bench.spec, vocab, seed)
    packed = common.make_workload(bench.spec, vocab, seed, budget_tokens=budget)
    return [batched, dataclasses.replace(packed, name=f"{bench.spec.name}-{budget // 1024}k")]


# ---- the runner ---------------------------------------------------------------------------------


@dataclasses.dataclass
class RunConfig:
    device: torch.device
    reps: int = 3
    target_tokens: int = 65536  # real tokens per timed repetition (>= 1 batch)
    time_budget_s: float = 10.0


def _batch(bench: TrainBench, w: Workload, i: int, vocab: int) -> ts.TrainBatch:
    # the mask seed depends on the batch's first sequence, so batched and packed runs see equal masks
    return ts.mlm_batch(w.batch(i), bench.mask_id, vocab, bench.mask_prob, seed=1000 + w.batches[i][0])


def run_system(system: ts.TrainSystem, bench: TrainBench, ws: list[Workload], vocab: int, cfg: RunConfig,
               meta: dict[str, Any], probe: ts.TrainBatch) -> tuple[list[dict[str, Any]], torch.Tensor | None]:
    """Records of one system on every workload (failures recorded, never raised) and its probe losses."""
    meta = {**meta, "model": bench.model, "precision": system.precision}
    if system.absent:
        print(f"[{bench.model} {system.name}] {system.absent}", flush=True)
        return [common.make_record(system.name, w.name, None, None, status="absent", error=system.absent, **meta)
                for w in ws], None
    dev = cfg.device
    try:
        common.reset_memory(dev)
        system.setup()
        meta.update(system.info())
    except Exception as e:  # noqa: BLE001 - one broken system must not end the run
        traceback.print_exc()
        system.close()
        err = f"{type(e).__name__}: {e}"[:300]
        print(f"[{bench.model} {system.name}] FAILED in setup: {err}", flush=True)
        return [common.make_record(system.name, w.name, None, None, status="failed", error=err, **meta)
                for w in ws], None
    probe_out = None
    try:
        with torch.no_grad():  # the first step's loss, before any update
            probe_out = system.token_losses(system.prepare(probe)).float().cpu()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        print(f"[{bench.model} {system.name}] probe failed: {type(e).__name__}: {e}"[:300], flush=True)
    records = [_run_one(system, bench, w, vocab, cfg, meta) for w in ws]
    system.close()
    common.reset_memory(dev)
    return records, probe_out


def _run_one(system: ts.TrainSystem, bench: TrainBench, w: Workload, vocab: int, cfg: RunConfig,
             meta: dict[str, Any]) -> dict[str, Any]:
    dev, tag = cfg.device, f"[{bench.model} {system.name}] {w.name}"
    reason = system.skip_reason(w)
    if reason:
        print(f"{tag}: skipped ({reason})", flush=True)
        return common.make_record(system.name, w.name, None, None, status="skipped", error=reason, **meta)
    inputs: dict[int, Any] = {}
    try:
        common.reset_memory(dev)
        reps = common.rotation(w, cfg.reps, cfg.target_tokens)
        inputs = {i: system.prepare(_batch(bench, w, i, vocab)) for i in sorted({i for r in reps for i in r})}
        losses: list[torch.Tensor] = []
        t0 = time.perf_counter()
        for i in inputs:  # warm-up: every timed input once (compile, autotune, optimizer state)
            losses.append(system.step(inputs[i]))
        common._sync(dev)
        warm_s = time.perf_counter() - t0
        ms = common.time_reps(lambda x: losses.append(system.step(x)), inputs, reps, dev, cfg.time_budget_s)
        reserved, allocated = common.peak_memory_gb(dev)
        last = float(losses[-1])
        if last != last or last in (float("inf"), float("-inf")):
            raise RuntimeError(f"the training loss is not finite ({last})")
        tokens = [sum(w.batch_tokens(i) for i in idx) for idx in reps[: len(ms)]]
        tps = statistics.median(t / (m / 1e3) for t, m in zip(tokens, ms))
        step_ms = statistics.median(m / len(idx) for idx, m in zip(reps, ms))
        mem = "" if reserved is None else f", peak reserved {reserved:.2f} GB"
        print(f"{tag}: {tps / 1e3:,.1f}k tokens/s, {step_ms:.1f} ms/step (median of {len(ms)} reps x "
              f"{len(reps[0])} steps{mem}; warm-up {warm_s:.1f}s; loss {float(losses[0]):.4f} -> {last:.4f})",
              flush=True)
        return common.make_record(system.name, w.name, tps, reserved, status="ok", step_ms=step_ms,
                                  tokens_per_step=statistics.mean(t / len(idx) for t, idx in zip(tokens, reps)),
                                  peak_allocated_gb=allocated, reps=len(ms), steps_per_rep=len(reps[0]),
                                  warmup_s=warm_s, first_loss=float(losses[0]), last_loss=last, **meta)
    except Exception as e:  # noqa: BLE001 - OOM, unsupported shape, compile failure ...
        traceback.print_exc()
        err = f"{type(e).__name__}: {e}"[:300]
        print(f"{tag}: FAILED {err}", flush=True)
        return common.make_record(system.name, w.name, None, None, status="failed", error=err, **meta)
    finally:
        inputs.clear()
        common.reset_memory(dev)


def probe_report(probes: dict[str, torch.Tensor | None], reference: str, tol: float) -> list[tuple[str, Any]]:
    """(system, (mean loss, max |per-token loss - reference's| / reference mean, agrees)) per system.

    Per-token losses, not just the mean: at random init every model's mean loss is near ln(V), but
    the per-token losses spread by the logits' scale (printed as `spread`), so a system computing a
    different function differs by about that much, while bf16 rounding moves them by << 1%."""
    ref = probes.get(reference)
    out = []
    for name, t in probes.items():
        if t is None:
            out.append((name, None))
            continue
        if ref is None or ref.shape != t.shape:
            out.append((name, (float(t.mean()), None, None)))
            continue
        diff = float((t - ref).abs().max() / ref.mean().abs())
        out.append((name, (float(t.mean()), diff, diff <= tol)))
    return out


# ---- targets (issue 7) --------------------------------------------------------------------------


def _val(records: list[dict[str, Any]], model: str, system: str, workload: str, key: str) -> float | None:
    for r in records:
        if (r["model"], r["system"], r["workload"]) == (model, system, workload) and r.get("status") == "ok":
            return r.get(key)
    return None


def _check(text: str, a: float | None, b: float | None, want: float, higher: bool, unit: str) -> str:
    if a is None or b is None or b == 0:
        return f"n/a    {text} (a system is missing: absent, skipped or failed)"
    ratio = a / b
    ok = ratio >= want if higher else ratio <= want
    return f"{'ok    ' if ok else 'MISSED'} {text}: {ratio:.2f}x (target {'>=' if higher else '<='} {want}x{unit})"


def target_lines(records: list[dict[str, Any]], benches_run: dict[str, TrainBench], budget: int) -> list[str]:
    """The issue's targets on this run's records, one 'ok / MISSED / n/a' line each."""
    k = f"-{budget // 1024}k"
    lines = []
    for name, b in benches_run.items():
        w, wp = b.spec.name, b.spec.name + k
        tps = lambda s, wl: _val(records, b.model, s, wl, "tokens_per_s")  # noqa: E731
        mem = lambda s, wl: _val(records, b.model, s, wl, "peak_reserved_gb")  # noqa: E731
        if b.reference == "torch-packed":  # ModernBERT
            lines += [
                _check(f"{name} speed: packedenc {wp} vs torch-packed {wp}", tps("packedenc", wp),
                       tps("torch-packed", wp), 1.5, True, ""),
                _check(f"{name} speed: packedenc {wp} vs hf-sdpa {w}", tps("packedenc", wp), tps("hf-sdpa", w), 3.0,
                       True, ""),
                _check(f"{name} peak reserved: packedenc {wp} vs hf-sdpa {w}", mem("packedenc", wp),
                       mem("hf-sdpa", w), 0.7, False, ""),
                _check(f"{name} peak reserved, same batches: packedenc {w} vs hf-sdpa {w}", mem("packedenc", w),
                       mem("hf-sdpa", w), 0.7, False, ""),
            ]
        else:  # DeBERTa: against the faster DisentangledFlash path
            df = [(s, wl, tps(s, wl)) for s, wl in (("disentangled-flash", w), ("disentangled-flash-packed", wp),
                                                     ("disentangled-flash-packed", w))]
            best = max((x for x in df if x[2] is not None), key=lambda x: x[2], default=("disentangled-flash", w, None))
            lines += [
                _check(f"{name} speed: packedenc {wp} vs {best[0]} {best[1]} (fastest DisentangledFlash)",
                       tps("packedenc", wp), best[2], 1.5, True, ""),
                _check(f"{name} speed: packedenc {wp} vs hf-eager {w}", tps("packedenc", wp), tps("hf-eager", w), 3.0,
                       True, ""),
                _check(f"{name} peak reserved: packedenc {wp} vs disentangled-flash-packed {wp}", mem("packedenc", wp),
                       mem("disentangled-flash-packed", wp), 1.0, False, ""),
                _check(f"{name} peak reserved, same batches: packedenc {w} vs disentangled-flash {w}",
                       mem("packedenc", w), mem("disentangled-flash", w), 1.0, False, ""),
            ]
    return lines


# ---- entry --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", help="default: all (modernbert-base deberta-v3-base; tiny: *-tiny)")
    ap.add_argument("--systems", nargs="*", help="default: every system of each model")
    ap.add_argument("--tiny", action="store_true", help="tiny models and workloads (CPU smoke run of the harness)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per (system, workload)")
    ap.add_argument("--target-tokens", type=int, help="real tokens per repetition (default 65536; tiny 1024)")
    ap.add_argument("--budget", type=int, help="token budget of the packs (default 65536; tiny 1024)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=common.RESULTS_DIR)
    ap.add_argument("--no-write", action="store_true", help="print only; write no JSON")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU (use --tiny --device cpu to smoke-test the harness)")
        return 2
    all_benches = benches(args.tiny)
    unknown = set(args.models or ()) - set(all_benches)
    if unknown:
        raise SystemExit(f"unknown model(s) {sorted(unknown)}; choose from {sorted(all_benches)}")
    run_benches = {k: b for k, b in all_benches.items() if not args.models or k in args.models}
    budget = args.budget or (TINY_BUDGET if args.tiny else common.BUDGET_TOKENS)
    cfg = RunConfig(device, reps=args.reps, target_tokens=args.target_tokens or (1024 if args.tiny else 65536),
                    time_budget_s=2.0 if args.tiny else 10.0)
    compute = torch.bfloat16 if device.type == "cuda" else None  # fp32 on the CPU: the probe check is exact
    tol = 1e-2 if compute is not None else 1e-4
    env = common.environment(device)
    env["disentangled_flash"] = ts.disentangled_flash_version()
    commit = common.git_commit()
    print("command: python -m benchmarks.train " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])))
    print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()) + f", commit={commit}")
    meta = dict(gpu=env["device"], commit=commit, torch=env["torch"], triton=env.get("triton"),
                transformers=env.get("transformers"), budget_tokens=budget,
                compute_dtype=str(compute or torch.float32).replace("torch.", ""))

    t0 = time.perf_counter()
    records: list[dict[str, Any]] = []
    probe_lines: list[str] = []
    known: set[str] = set()
    for name, bench in run_benches.items():
        host = bench.make_params()
        vocab = host.config.vocab_size
        ws = workloads(bench, vocab, budget, args.seed)
        for w in ws:
            print(f"{name} workload {w.name}: {len(w.lengths)} sequences, {w.num_tokens:,} tokens, "
                  f"{len(w.batches)} batches")
        systems = bench.make_systems(host, device, compute)
        known |= {s.name for s in systems}
        systems = [s for s in systems if (s.name in args.systems if args.systems else not s.optional)]
        probe = _batch(bench, ws[0], 0, vocab)
        probes: dict[str, Any] = {}
        for s in systems:
            recs, probes[s.name] = run_system(s, bench, ws, vocab, cfg, meta, probe)
            records += recs
        ref = probes.get(bench.reference)
        if ref is not None:
            probe_lines.append(f"{name}: {ref.numel()} masked tokens; spread of {bench.reference}'s per-token "
                               f"losses (std / mean) {float(ref.std() / ref.mean()):.2e}")
        for sname, p in probe_report(probes, bench.reference, tol):
            line = (f"{name} {sname}: probe failed or absent" if p is None else
                    f"{name} {sname}: first-step loss {p[0]:.5f}" + ("" if p[1] is None else
                    f", max |per-token loss - {bench.reference}'s| / mean = {p[1]:.2e} "
                    f"({'agrees' if p[2] else 'DISAGREES'}, tol {tol:g})"))
            probe_lines.append(line)
            for r in records:
                if r["model"] == bench.model and r["system"] == sname and p is not None:
                    r["probe_loss"], r["probe_rel_diff"] = p[0], p[1]

    if set(args.systems or ()) - known:
        print(f"note: unknown system(s) {sorted(set(args.systems) - known)} ignored; known: {sorted(known)}")
    print(f"\ntraining step on {env['device']} (commit {commit}, {time.perf_counter() - t0:.0f}s); "
          f"{meta['compute_dtype']} compute, fp32 master weights, AdamW")
    for r in records:
        if r.get("status") == "ok":
            print(f"  {r['model']:<16} {r['system']:<26} {r['workload']:<10} {r['step_ms']:9.1f} ms/step "
                  f"{r['tokens_per_s'] / 1e3:10,.1f}k tok/s  {r['peak_reserved_gb'] or 0:6.2f} GB")
        else:
            print(f"  {r['model']:<16} {r['system']:<26} {r['workload']:<10} {r['status']}: {r.get('error')}")
    print("\nprobe (each system's loss on the first step, same weights and masks):")
    print("\n".join("  " + x for x in probe_lines))
    print("\ntargets (issue 7):")
    print("\n".join("  " + x for x in target_lines(records, run_benches, budget)))
    if not args.no_write:
        path = args.out_dir / f"train_{common.gpu_slug(env['device'])}{'_tiny' if args.tiny else ''}.json"
        common.write_records(records, path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
