"""Data-parallel scaling on 1 and N GPUs, in one run: the `distributed` family.

    python -m benchmarks distributed                      # 2 x H200: embed + train on 1 and 2 GPUs, < ~4 min
    python -m benchmarks distributed --gpus 1 2 4         # more GPUs, when the host has them
    python -m benchmarks distributed --device cpu --tiny  # CPU smoke run of the harness (gloo)

For every system (`embed`, `train`; see `benchmarks/distributed_worker.py` for what each times)
and GPU count, this process launches the work in fresh processes: alone for 1 GPU (no process
group, plain module: the honest single-GPU baseline), under `torchrun --standalone` for N > 1. A
launch that fails or hangs is recorded as failed with its error and the run goes on. Records go to
`benchmarks/results/distributed_<gpu>.json` with `system`, `workload`, `gpus`, `tokens_per_s`,
`scaling` (tokens/s on that many GPUs over 1 GPU in this run), `gpu`, `commit`, `command`; the
targets (embed >= 1.9x, train >= 1.8x on 2 GPUs) are in `benchmarks/targets.py`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import targets
from benchmarks.records import RESULTS_DIR, Run, columns, thousands, write_records

ROOT = Path(__file__).resolve().parents[1]
BUDGET_TOKENS = 65536
# NVLink multicast stays off on shared hosts (it can take the GPUs out of service): set it for the children
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def worker_args(args: argparse.Namespace, system: str, result: str) -> list[str]:
    """The worker's command-line arguments (the same for 1 and N processes)."""
    out = ["--worker", "--system", system, "--result", result, "--device", args.device, "--reps", str(args.reps),
           "--embed-budget", str(args.embed_budget), "--train-budget", str(args.train_budget),
           "--warmup-steps", str(args.warmup_steps), "--steps-per-rep", str(args.steps_per_rep),
           "--hang-s", str(max(30, args.timeout - 15))]
    return out + (["--tiny"] if args.tiny else [])


def launch(args: argparse.Namespace, system: str, gpus: int) -> dict[str, Any]:
    """Run one (system, GPU count) in fresh processes; its result dict, or a failure record."""
    with tempfile.TemporaryDirectory(prefix="pe-dist-") as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "benchmarks", "distributed", *worker_args(args, system, result)]
        if gpus > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus),
                   "-m", "benchmarks", "distributed", *worker_args(args, system, result)]
        env = {**os.environ, **SAFE_ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        if args.device == "cpu":
            env.setdefault("OMP_NUM_THREADS", "1")
        print(f"\n=== {system} on {gpus} {'process' if args.device == 'cpu' else 'GPU'}(s): "
              + " ".join(shlex.quote(c) for c in cmd[1:]), flush=True)
        rc, tail, timed_out = _stream(cmd, env, args.timeout)
        got: dict[str, Any] = {}
        if os.path.exists(result):
            got = json.loads(Path(result).read_text())
        if rc == 0 and got.get("status") == "ok":
            return got
        err = got.get("error") or ("timed out after %ds" % args.timeout if timed_out else f"exit code {rc}")
        print(f"[{system} x{gpus}] FAILED: {err}\n" + "".join(tail), flush=True)
        return {"system": system, "gpus": gpus, "status": "failed", "error": err, "tokens_per_s": None,
                "workload": got.get("workload")}


def _stream(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, list[str], bool]:
    """Run `cmd` in its own process group, echoing its output; kill the group on timeout."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=40)
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the launcher and every worker it started
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        assert p.stdout is not None
        for line in p.stdout:
            tail.append(line)
            print("  " + line, end="", flush=True)
        rc = p.wait()
    finally:
        timer.cancel()
    return rc, list(tail), timed_out.is_set()


def make_records(results: list[dict[str, Any]], run: Run, **fields: Any) -> list[dict[str, Any]]:
    """One record per (system, gpus); `scaling` against the same system's 1-GPU tokens/s of this run."""
    base = {r["system"]: r.get("tokens_per_s") for r in results if r["gpus"] == 1}
    workload = {r["system"]: r["workload"] for r in results if r.get("workload")}
    records = []
    for r in results:
        tps, one = r.get("tokens_per_s"), base.get(r["system"])
        extra = {k: v for k, v in r.items() if k not in ("system", "workload", "status", "error", "gpu")}
        records.append(run.record(r["system"], workload.get(r["system"], "?"), r.get("status", "ok"),
                                  error=r.get("error"), **{**fields, **extra},
                                  scaling=tps / one if tps and one else None))
    return records


def format_table(records: list[dict[str, Any]]) -> str:
    rows = [["system", "workload", "gpus", "tokens/s", "scaling", "peak GB"]]
    for r in records:
        tps = "FAILED" if r["tokens_per_s"] is None else thousands(r["tokens_per_s"])
        sc = "" if r["scaling"] is None else f"{r['scaling']:.2f}x"
        mem = "" if r.get("peak_reserved_gb") is None else f"{r['peak_reserved_gb']:.1f}"
        rows.append([r["system"], r["workload"], str(r["gpus"]), tps, sc, mem])
    lines = columns(rows)
    lines += [f"FAILED {r['system']} x{r['gpus']}: {r['error']}" for r in records if r["tokens_per_s"] is None]
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks distributed", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="GPU counts to run (default 1 2)")
    ap.add_argument("--systems", nargs="+", default=["embed", "train"], choices=["embed", "train"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo processes (smoke test)")
    ap.add_argument("--tiny", action="store_true", help="tiny ModernBERT and workloads (CPU smoke test)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (median reported)")
    ap.add_argument("--embed-budget", type=int, help="tokens per embedding pack (default 65536; tiny 2048)")
    ap.add_argument("--train-budget", type=int, help="tokens per GPU per training step (default 65536; tiny 1024)")
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--steps-per-rep", type=int, help="training steps per timed repetition (default 3; tiny 2)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per launch before it is killed")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--no-write", action="store_true", help="print only; write no JSON")
    # worker side (one process of a launch)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--hang-s", type=int, default=600, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.embed_budget = args.embed_budget or (2048 if args.tiny else BUDGET_TOKENS)
    args.train_budget = args.train_budget or (1024 if args.tiny else 65536)
    args.steps_per_rep = args.steps_per_rep or (2 if args.tiny else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        from benchmarks.distributed_worker import main as worker_main

        return worker_main(args)
    import torch

    gpus = sorted(set(args.gpus) | {1})  # scaling needs the 1-GPU run of the same invocation
    if args.device == "cuda":
        have = torch.cuda.device_count()  # this process only launches: it allocates nothing on a GPU
        if have == 0:
            print("no CUDA device: this benchmark needs GPUs (use --device cpu --tiny to smoke-test the harness)")
            return 2
        if max(gpus) > have:
            print(f"note: only {have} GPU(s) here; skipping {[g for g in gpus if g > have]}")
            gpus = [g for g in gpus if g <= have]
    print(f"systems {args.systems}, GPU counts {gpus}")
    t0 = time.perf_counter()
    results = [launch(args, s, g) for s in args.systems for g in gpus]
    # the GPU's name comes from the workers: this process never touches a GPU
    gpu = next((r["gpu"] for r in results if r.get("gpu")), "cpu" if args.device == "cpu" else "unknown")
    run = Run.start("distributed", torch.device("cpu"), argv or [], gpu=gpu)
    records = make_records(results, run, model="modernbert-tiny" if args.tiny else "modernbert-base",
                           dtype="fp32" if args.device == "cpu" else "bf16")
    print(f"\n{records[0]['model']} data parallel on {run.gpu} ({records[0]['dtype']}, commit {run.commit}, "
          f"{time.perf_counter() - t0:.0f}s); real tokens/s, scaling over 1 GPU in this run:")
    print(format_table(records))
    lines = targets.report("distributed", records)
    if lines:
        print("\ntargets:\n" + "\n".join("  " + x for x in lines))
    if not args.no_write:
        path = run.path(args.out_dir, "_tiny" if args.tiny else "")
        write_records(records, path)
        print(f"wrote {path}")
    return 0 if all(r["tokens_per_s"] is not None for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
