"""Where the device time of one ModernBERT-base forward goes, kernel by kernel, per backend.

    python3 -m benchmarks.kernel_profile --out gpu_out/kernel_profile.txt          # H200: ~1 min
    python3 -m benchmarks.kernel_profile --workloads long doc-64k --backends triton auto

For each workload (the ModernBERT family's, first batch) and backend: torch.profiler over `reps`
eager forwards (no grad, after warm-up), each CUDA kernel's device time summed by name and divided
by `reps` (ms a forward), grouped into classes (GEMM, attention, norm, GLU, RoPE, other) by the
name. The classes show which part of a forward a backend change can move: the ratio of two
backends' forwards is bounded by the parts they share. Random weights, bf16.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

# kernel-name fragments -> class; the first match wins (lower-cased names)
CLASSES = (
    ("glu", ("glu", "gelu")),  # before attention: our GLU, norm and RoPE kernels end in _fwd_kernel too
    ("norm", ("_ln_", "layer_norm", "layernorm", "rmsnorm")),
    ("rope", ("rotary", "rope")),
    ("attention", ("attn", "attention", "flash", "fmha", "_fwd_kernel", "_bwd_kernel")),
    ("gemm", ("gemm", "sm90_xmma", "cutlass", "nvjet", "cublas", "wgmma")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, parts in CLASSES:
        if any(p in low for p in parts):
            return cls
    return "other"


def wall_ms(params, ids, cu, max_seqlen: int, backend: str, reps: int) -> float:
    """One forward's CUDA-event time (median of `reps`): what the family's `ms` counts. Beside the
    kernels' sum it shows how long the GPU waited inside the call (host work before the first
    launch, launch gaps)."""
    import packedenc as pe
    from benchmarks import common

    with torch.no_grad():
        return common.median_ms(lambda: pe.encode(params, ids, cu, max_seqlen, backend=backend), reps=reps, warmup=2)


def profile_forward(params, ids, cu, max_seqlen: int, backend: str, reps: int) -> dict[str, tuple[int, float]]:
    """{kernel name: (launches a forward, device ms a forward)} over `reps` forwards."""
    import packedenc as pe
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(3):
            pe.encode(params, ids, cu, max_seqlen, backend=backend)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                pe.encode(params, ids, cu, max_seqlen, backend=backend)
            torch.cuda.synchronize()
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = totals[ev.name]
            t[0] += 1
            t[1] += ev.device_time_total / 1e3  # us -> ms
    return {k: (round(n / reps), ms / reps) for k, (n, ms) in totals.items()}


def table(name: str, backend: str, kernels: dict[str, tuple[int, float]], top: int, wall: float | None = None) -> str:
    total = sum(ms for _, ms in kernels.values())
    by_class: dict[str, float] = collections.defaultdict(float)
    for k, (_, ms) in kernels.items():
        by_class[kernel_class(k)] += ms
    waited = "" if wall is None else f"; {wall:.2f} ms a forward by CUDA events: the GPU idle {wall - total:.2f} ms of it"
    out = [f"## {name}, backend={backend}: {total:.2f} ms of kernels a forward{waited}",
           "  " + ", ".join(f"{c} {ms:.2f} ({ms / total:.0%})" for c, ms in sorted(by_class.items(), key=lambda x: -x[1]))]
    for k, (n, ms) in sorted(kernels.items(), key=lambda x: -x[1][1])[:top]:
        out.append(f"  {ms:8.3f} ms {n:5d}x  {kernel_class(k):9s} {k[:110]}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.kernel_profile", description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="*", default=["long", "doc-64k"])
    ap.add_argument("--backends", nargs="*", default=["triton", "auto"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--out", type=Path, default=None, help="also write the tables to this file")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this profile needs a GPU")
        return 2
    import packedenc as pe
    from benchmarks.workloads import MODERNBERT_WORKLOADS, workload_named
    from packedenc.models.modernbert import ModernBertConfig, init

    params = pe.tree_to(init(ModernBertConfig(), torch.Generator().manual_seed(0), dtype=torch.bfloat16), "cuda")
    parts = []
    for wl_name in a.workloads:
        b = workload_named(wl_name, MODERNBERT_WORKLOADS, params.config.vocab_size).batch(0)
        ids, cu = b.ids.to("cuda"), b.cu_seqlens.to("cuda")
        for backend in a.backends:
            try:
                kernels = profile_forward(params, ids, cu, b.max_seqlen, backend, a.reps)
                wall = wall_ms(params, ids, cu, b.max_seqlen, backend, 9)
            except Exception as e:  # noqa: BLE001 - one backend missing (no stack) leaves the others
                parts.append(f"## {wl_name}, backend={backend}: {type(e).__name__}: {e}"[:300])
                continue
            parts.append(table(f"{wl_name} ({int(ids.numel())} tokens)", backend, kernels, a.top, wall))
            print(parts[-1], flush=True)
    if a.out:
        from benchmarks.records import replace_text

        a.out.parent.mkdir(parents=True, exist_ok=True)
        replace_text(a.out, "\n\n".join(parts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
