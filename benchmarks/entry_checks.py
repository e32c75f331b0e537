"""What encode's entry checks cost on the GPU, and that they never sync there unless asked (issue 23).

    python -m benchmarks.entry_checks OUT_DIR        # CUDA only; about a minute on an H200

1. `prepare_inputs` (the checks every token model runs at entry) against a copy of the version
   before issue 23, on CUDA tensors with max_seqlen and positions given: host microseconds per call,
   and no host sync (`torch.cuda.set_sync_debug_mode("error")`).
2. The eager host (enqueue) time of ModernBERT-base (bf16) on one batch of the query workload, to put
   the difference of 1 against what a call costs in all.
3. `validate=True` on the GPU still finds a bad id, a bad boundary and a bad position.

Prints a short table and writes `OUT_DIR/entry_checks_<gpu>.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import packedenc as pe
from benchmarks import common
from benchmarks.encode import MODELS
from packedenc.models.common import prepare_inputs
from packedenc.packing import check_cu_seqlens, check_ids, positions_from_cu_seqlens


def old_prepare_inputs(ids, cu_seqlens, max_seqlen, positions, vocab_size, validate, need_positions=True):
    """`prepare_inputs` as it was before issue 23 (the baseline of the timing)."""
    check_ids(ids, vocab_size, values=False)
    check_cu_seqlens(cu_seqlens, values=False)
    if cu_seqlens.device != ids.device:
        raise pe.InputError("devices")
    values = validate or (ids.device.type == "cpu" and not torch.compiler.is_compiling())
    if values:
        check_ids(ids, vocab_size)
        check_cu_seqlens(cu_seqlens, ids.numel())
    if cu_seqlens.dtype != torch.int32:
        cu_seqlens = cu_seqlens.to(torch.int32)
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if positions is None:
        positions = positions_from_cu_seqlens(cu_seqlens, ids.numel()) if need_positions else None
    elif positions.shape != ids.shape:
        raise pe.InputError("positions")
    return ids, cu_seqlens, int(max_seqlen), positions


def per_call_us(fn, n: int = 20000) -> float:
    for _ in range(100):
        fn()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(best)


def check_validate(params, batch) -> list[str]:
    """validate=True on CUDA tensors: each bad input must be a packedenc InputError."""
    bad = {
        "id out of range": dict(ids=batch.ids.clone().index_fill_(0, torch.tensor([1], device="cuda"), 10**6)),
        "cu_seqlens past the end": dict(cu_seqlens=batch.cu_seqlens + torch.arange(
            batch.cu_seqlens.numel(), device="cuda", dtype=torch.int32)),
        "negative position": dict(positions=batch.positions - 5),
    }
    failures = []
    for name, change in bad.items():
        kw = {**dict(ids=batch.ids, cu_seqlens=batch.cu_seqlens, positions=batch.positions), **change}
        try:
            pe.encode(params, kw["ids"], kw["cu_seqlens"], batch.max_seqlen, kw["positions"], validate=True)
            failures.append(f"{name}: not refused")
        except pe.InputError:
            pass
    return failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    commit, gpu = common.git_commit(), common.gpu_name(dev)
    rows, records = [], []
    with torch.inference_mode():
        for name in ("modernbert-base",):
            params = pe.tree_to(MODELS[name].make_params(torch.bfloat16), dev)
            cfg = params.config
            w = common.make_workload(common.MODERNBERT_WORKLOADS["query"], cfg.vocab_size)
            b = w.batch(0)
            batch = pe.pack(pe.unpack(b.ids, b.cu_seqlens), device=dev)
            a = (batch.ids, batch.cu_seqlens, batch.max_seqlen, batch.positions, cfg.vocab_size, False)
            torch.cuda.set_sync_debug_mode("error")  # any host sync in the entry checks raises
            try:
                new_us = per_call_us(lambda: prepare_inputs(*a))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            old_us = per_call_us(lambda: old_prepare_inputs(*a))
            run = lambda: pe.encode(params, batch.ids, batch.cu_seqlens, batch.max_seqlen, batch.positions)  # noqa: E731
            enqueue_ms, total_ms = common.host_ms(run, reps=20)
            failures = check_validate(params, batch)
            rows.append([name, f"{batch.num_tokens}", f"{old_us:.1f}", f"{new_us:.1f}", f"{new_us - old_us:+.1f}",
                         f"{enqueue_ms:.2f}", f"{total_ms:.2f}", "ok" if not failures else "; ".join(failures)])
            records.append(common.make_record(
                "packedenc-entry-checks", f"{name}/query", None, None, gpu=gpu, commit=commit,
                prepare_inputs_us=new_us, prepare_inputs_before_us=old_us, encode_enqueue_ms=enqueue_ms,
                encode_total_ms=total_ms, validate_failures=failures,
                command="python -m benchmarks.entry_checks OUT_DIR"))
    head = ["model", "tokens", "checks before (us)", "checks now (us)", "delta (us)", "encode enqueue (ms)",
            "encode total (ms)", "validate=True on GPU"]
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"entry_checks_{common.gpu_slug(gpu)}.json"
    out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"wrote {out}")
    if any(r["validate_failures"] for r in records):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
