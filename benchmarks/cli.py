"""The options every benchmark family takes, and how a family run ends (table, targets, file).

    python -m benchmarks <family> [--systems S ...] [--workloads W ...] [--quick | --tiny]
        [--device cpu] [--reps N] [--target-tokens N] [--seed N] [--profile] [--out-dir DIR] [--no-write]

`--tiny` shrinks models and workloads for a CPU smoke run of the harness (`tests/test_benchmarks.py`);
`--quick` keeps the real models with fewer, shorter repetitions. Both write to their own files
(`<family>_<gpu>_tiny.json`, `_quick.json`), never over the full run's records.

`--passes 2` (the inference families and `train`) times every system twice, in the family's order and then in
reverse, and records the median of the passes (each pass's figure in `*_passes`): a host whose
speed drifts during a run (the GPU machines' hosts do, by tens of percent) then biases no system
for its place in the order. Use it for A/B comparisons that decide a row of `kernels/auto.py`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from benchmarks import targets
from benchmarks.common import BenchConfig, System
from benchmarks.records import RESULTS_DIR, Run, format_table, rate_cell, write_records


def parser(family: str, description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks {family}", description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", nargs="*", help="default: every system of the family (optional ones only when named)")
    ap.add_argument("--workloads", nargs="*", help="default: the family's workloads")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer, shorter repetitions (records in *_quick.json)")
    size.add_argument("--tiny", action="store_true",
                      help="tiny models and workloads: a CPU smoke run of the harness (records in *_tiny.json)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, help="timed repetitions (default 5; quick 3; tiny 2)")
    ap.add_argument("--target-tokens", type=int, help="real tokens per repetition (default 65536; quick 16384)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true",
                    help="print torch.profiler's top ops of one batch of every (system, workload)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--no-write", action="store_true", help="print only; write no records")
    return ap


def add_passes(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`--passes N` (the families that time systems against each other: modernbert, deberta, bert, train)."""
    ap.add_argument("--passes", type=_positive, default=1,
                    help="time every system N times, every other pass in reverse order; records the median")
    return ap


def _positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return int(value)


def device_of(args: argparse.Namespace) -> torch.device | None:
    """The run's device, or None (with the reason printed) when it asks for CUDA and there is none."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU (`--tiny --device cpu` smoke-tests the harness)")
        return None
    return device


def bench_config(args: argparse.Namespace, device: torch.device) -> BenchConfig:
    reps, target, budget = (2, 256, 1.0) if args.tiny else (3, 16384, 5.0) if args.quick else (5, 65536, 20.0)
    return BenchConfig(device, reps=args.reps or reps, target_tokens=args.target_tokens or target,
                       time_budget_s=budget, host_batches=2 if args.tiny else 5, profile=args.profile)


def suffix(args: argparse.Namespace) -> str:
    return "_tiny" if args.tiny else "_quick" if args.quick else ""


def select(systems: Sequence[System], names: Sequence[str] | None, strict: bool = True) -> list[System]:
    """The systems named (any order: the family's order is kept), or every non-optional one.
    `strict`: a name that is not among `systems` ends the run (families running several models
    check their names against all of them instead)."""
    known = [s.name for s in systems]
    unknown = sorted(set(names or ()) - set(known))
    if unknown and strict:
        raise SystemExit(f"unknown system(s) {unknown}; choose from {known}")
    return [s for s in systems if (s.name in names if names else not s.optional)]


def finish(run: Run, records: list[dict[str, Any]], args: argparse.Namespace, title: str,
           fmt: Callable[[dict[str, Any]], str] = rate_cell, rows: tuple[str, ...] = ("system",),
           col: str = "workload") -> int:
    """Print the table and the family's targets, write the records; the exit code (0)."""
    print(f"\n{title} on {run.gpu} (commit {run.commit}):")
    print(format_table(records, fmt, rows, col))
    lines = targets.report(run.family, records)
    if lines:
        print("\ntargets:\n" + "\n".join("  " + x for x in lines))
    if not args.no_write:
        path = run.path(args.out_dir, suffix(args))
        write_records(records, path)
        print(f"wrote {path}")
    return 0
